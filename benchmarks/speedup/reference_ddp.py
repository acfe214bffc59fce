"""Plain-PyTorch reference: what a user gets on the text task without this project.

MiniLM-L6 + mean pooling + a linear head, trained with ``torch.nn.parallel.DistributedDataParallel`` on
gloo, global batch 32 split over the processes, AdamW, the same Rotten Tomatoes snippets (the project's
data loader is used only so that the samples and tokenisation are identical), each batch padded to its
longest snippet. Reports the median step time over the timed steps after a warm-up.

Run it (the speedup benchmark does)::

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/speedup/reference_ddp.py --out /tmp/reference.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModel, AutoTokenizer

from pipetransformer.data import load_datasets
from pipetransformer.models import minilm_path

__all__ = ["MeanPoolClassifier", "main"]

GLOBAL_BATCH = 32
WARMUP_STEPS = 5
TIMED_STEPS = 20
MAX_LENGTH = 64
LEARNING_RATE = 1e-4
WEIGHT_DECAY = 0.01
NUM_CLASSES = 2
SEED = 0


class MeanPoolClassifier(nn.Module):
    """Encoder, mean over the real (unpadded) tokens, linear head: the project's text model, written plainly."""

    def __init__(self, path: str, num_classes: int) -> None:
        super().__init__()
        self.encoder = AutoModel.from_pretrained(path, attn_implementation="sdpa", local_files_only=True)
        self.encoder.pooler = None  # unused by mean pooling; DDP fails on parameters that get no gradient
        self.dropout = nn.Dropout(self.encoder.config.hidden_dropout_prob)
        self.head = nn.Linear(self.encoder.config.hidden_size, num_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return self.head(self.dropout(pooled))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the result (written by rank 0)")
    parser.add_argument("--pad-to", type=int, default=None,
                        help="fixed sequence length (the first measurement, before the cache was built, used 64); "
                        "default: batch's longest")
    parser.add_argument("--steps", type=int, default=TIMED_STEPS)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(SEED)
    path = minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    train = load_datasets("rotten_tomatoes", tokenizer=tokenizer, max_length=MAX_LENGTH, seed=SEED).train
    model = DistributedDataParallel(MeanPoolClassifier(path, NUM_CLASSES))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    loss_fn = nn.CrossEntropyLoss()
    local = GLOBAL_BATCH // world
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(SEED))
    times: list[float] = []
    model.train()
    for step in range(WARMUP_STEPS + args.steps):
        first = step * GLOBAL_BATCH + rank * local
        batch = train.get_batch(order[first:first + local], pad_to=args.pad_to)
        dist.barrier()  # every rank starts the step together, as in a synchronous trainer
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(*batch.inputs), batch.labels)
        loss.backward()
        optimizer.step()
        dist.barrier()
        if step >= WARMUP_STEPS:
            times.append(time.perf_counter() - started)
    if rank == 0:
        step_s = statistics.median(times)
        result = {"mode": f"torch DDP, {world} processes x {torch.get_num_threads()} thread(s)",
                  "global_batch": GLOBAL_BATCH, "pad_to": args.pad_to or "batch's longest",
                  "timed_steps": args.steps, "warmup_steps": WARMUP_STEPS, "median_step_s": step_s,
                  "samples_per_s": GLOBAL_BATCH / step_s, "mean_step_s": statistics.fmean(times)}
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
