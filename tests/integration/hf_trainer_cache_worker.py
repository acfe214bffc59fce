"""One worker of the Trainer cache test, run under torchrun: a tiny random BERT trained by the Hugging Face Trainer
on Rotten Tomatoes snippets with the prior's layers frozen (no decisions by evidence), once plainly and once
serving the frozen layers from the activation cache; each rank writes ``rank{N}.json``."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainingArguments

from hf_text import MAX_LENGTH, rotten_tomatoes, tiny_classifier
from pipetransformer.config import CacheConfig, FreezeConfig
from pipetransformer.integrations import AutoFreezeCallback
from process_group import leave

SETTINGS = FreezeConfig(policy="none", prior=2)  # both runs freeze the same two layers before the first step


class IndexedRows(torch.utils.data.Dataset[dict[str, Any]]):
    """Rotten Tomatoes snippets as the Trainer's default collator wants them, each with its index."""

    def __init__(self, rows: int) -> None:
        self.data = rotten_tomatoes(rows)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"idx": index, "input_ids": self.data.input_ids[index],
                "attention_mask": self.data.attention_mask[index], "labels": self.data.labels[index]}


def _train(out: Path, rows: IndexedRows, epochs: int, cache: bool) -> dict[str, Any]:
    model = tiny_classifier(int(rows.data.input_ids.max()) + 1)
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=8, num_train_epochs=epochs,
                             learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                             ddp_backend="gloo", disable_tqdm=True, seed=0, dataloader_num_workers=0,
                             average_tokens_across_devices=False)
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    callback = AutoFreezeCallback.attach(trainer, SETTINGS, cache=CacheConfig(enabled=True, memory_gb=0.05)
                                         if cache else None, cache_max_length=MAX_LENGTH)
    trainer.train()
    served = callback.freezer.cache if callback.freezer else None
    return {"losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            "counts": [served.computed, served.advanced, served.hits] if served else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = IndexedRows(args.rows)
    out = Path(args.out)
    result = {"plain": _train(out / "plain", rows, args.epochs, cache=False),
              "cached": _train(out / "cached", rows, args.epochs, cache=True)}
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    leave()  # the Trainer's gloo group would otherwise meet the interpreter's finalization: SIGABRT, now and then
