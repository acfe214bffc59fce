"""One worker of the Hugging Face Trainer test, run under torchrun: MiniLM fine-tuned on Rotten Tomatoes snippets
with AutoFreezeCallback, a comm hook counting what DDP all-reduces each step; rank 0 writes ``result.json``."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import (AutoModelForSequenceClassification, EvalPrediction, Trainer, TrainerCallback,
                          TrainingArguments, set_seed)

from pipetransformer.config import FreezeConfig
from pipetransformer.data import SampleLimits, TextDataset, load_rotten_tomatoes
from pipetransformer.integrations import AutoFreezeCallback
from pipetransformer.models.hf import load_tokenizer, minilm_path
from process_group import leave

MAX_LENGTH = 32
# transformers 5.24 multiplies a model's loss by the process count when the model takes loss kwargs (every model
# does) and average_tokens_across_devices is on (its default), which a sequence-classification loss (a mean) does
# not undo: the loss and its gradient come out doubled on 2 processes. Off, the Trainer's own mean is right.


class Rows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """A TextDataset as the Trainer's default collator wants it."""

    def __init__(self, data: TextDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data.input_ids[index], "attention_mask": self.data.attention_mask[index],
                "labels": self.data.labels[index]}


def _record_buckets(state: list[int], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state.append(bucket.buffer().numel())
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


_record_buckets.__annotations__.update(bucket=dist.GradBucket, state=list[int],
                                       **{"return": torch.futures.Future[torch.Tensor]})


class BucketProbe(TrainerCallback):
    """Counts the gradient entries DDP all-reduces in each optimizer step, from a comm hook."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.buckets: list[int] = []
        self.per_step: list[int] = []
        self.training_modes: list[bool] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ddp = self.trainer.model_wrapped
        assert isinstance(ddp, DistributedDataParallel), type(ddp)
        ddp.register_comm_hook(self.buckets, _record_buckets)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.per_step.append(sum(self.buckets))
        self.buckets.clear()
        self.training_modes = [layer.training for layer in self.trainer.model.bert.encoder.layer]


class RestoredState(TrainerCallback):
    """At a resume, whether the optimizer state loaded equals the checkpoint's, tensor by tensor."""

    def __init__(self, trainer: Trainer, checkpoint: str | None) -> None:
        self.trainer = trainer
        self.checkpoint = checkpoint
        self.equal: bool | None = None
        self.tensors = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.checkpoint is None:
            return
        saved = torch.load(Path(self.checkpoint) / "optimizer.pt", weights_only=True)["state"]
        params = [p for group in self.trainer.optimizer.param_groups for p in group["params"]]
        loaded = self.trainer.optimizer.state
        self.equal = len(saved) == len(params) and all(
            torch.equal(saved[i][key], loaded[param][key]) for i, param in enumerate(params) for key in saved[i])
        self.tensors = sum(len(entry) for entry in saved.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--interval", type=int, default=5)
    parser.add_argument("--learned-min-steps", type=int, default=5)
    parser.add_argument("--threshold", type=float, default=FreezeConfig.threshold)
    parser.add_argument("--save-steps", type=int, default=None, help="checkpoint every this many steps")
    parser.add_argument("--resume", default=None, help="a checkpoint folder to resume from")
    parser.add_argument("--result", default="result.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(minilm_path())
    splits = load_rotten_tomatoes(tokenizer, MAX_LENGTH, limits=SampleLimits(train=256, test=128))
    set_seed(0)  # the new classification head is drawn now (the Trainer seeds only once the model exists); unseeded,
    # torch 2.13 draws it from a per-process random seed, so the freeze decisions moved from run to run
    model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=2)
    training = TrainingArguments(output_dir=str(Path(args.out) / "trainer"), per_device_train_batch_size=8,
                                 per_device_eval_batch_size=32, max_steps=args.steps, learning_rate=5e-5,
                                 logging_steps=5, average_tokens_across_devices=False, report_to=[],
                                 save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 1,
                                 use_cpu=True, ddp_backend="gloo", disable_tqdm=True, seed=0,
                                 dataloader_num_workers=0)

    def accuracy(prediction: EvalPrediction) -> dict[str, float]:
        return {"accuracy": float(np.mean(np.argmax(prediction.predictions, axis=-1) == prediction.label_ids))}

    trainer = Trainer(model=model, args=training, train_dataset=Rows(splits.train), eval_dataset=Rows(splits.test),
                      compute_metrics=accuracy)
    probe = BucketProbe(trainer)
    trainer.add_callback(probe)
    # the Trainer's mechanics under test, with the coherence test of short windows (it freezes within 30 steps) and
    # the prior of a third of the layers (recorded at step 0)
    settings = FreezeConfig(policy="coherence", prior="auto", max_advance=1, interval=args.interval,
                            interval_unit="steps", learned_min_steps=args.learned_min_steps, threshold=args.threshold)
    autofreeze = AutoFreezeCallback.attach(trainer, settings)
    restored = RestoredState(trainer, args.resume)
    trainer.add_callback(restored)
    trainer.train(resume_from_checkpoint=args.resume)
    metrics = trainer.evaluate()
    prior_layers = autofreeze.freezer.prior.layers if autofreeze.freezer else 0
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out, args.result).write_text(json.dumps({
            "restored_state_equal": restored.equal, "restored_tensors": restored.tensors,
            "decisions": autofreeze.decisions, "log_history": trainer.state.log_history,
            "reduced_per_step": probe.per_step, "parameters": sum(p.numel() for p in model.parameters()),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "prior_layers": prior_layers,
            "prior_frozen": sum(p.numel() for module in (model.bert.embeddings,
                                                         *model.bert.encoder.layer[:prior_layers])
                                for p in module.parameters()),
            "optimized": sum(p.numel() for group in trainer.optimizer.param_groups for p in group["params"]),
            "with_state": sum(p.numel() for p in trainer.optimizer.state),
            "training_modes": probe.training_modes, "eval": metrics,
            "coherence": autofreeze.freezer.policy.previous_coherence if autofreeze.freezer else None}))


if __name__ == "__main__":
    main()
    leave()  # the Trainer's gloo group would otherwise meet the interpreter's finalization: SIGABRT, now and then
