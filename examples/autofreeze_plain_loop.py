"""AutoFreeze in your own PyTorch loop (DDP or not): MiniLM fine-tuned on Rotten Tomatoes snippets, the frozen
layers' output served from the activation cache once they freeze.

    .venv/bin/python examples/autofreeze_plain_loop.py [--steps 300]
    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 examples/autofreeze_plain_loop.py
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForSequenceClassification

from pipetransformer.config import CacheConfig, FreezeConfig
from pipetransformer.data import SampleLimits, load_rotten_tomatoes
from pipetransformer.integrations import AutoFreezer
from pipetransformer.models.hf import load_tokenizer, minilm_path

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--rows", type=int, default=2000, help="training snippets")
parser.add_argument("--prior", default="none", type=lambda value: int(value) if value.isdigit() else value,
                    help="frozen before any evidence: none (the default), auto, embeddings or a layer count")
args = parser.parse_args()
if "RANK" in os.environ:  # started by torchrun
    dist.init_process_group("gloo")
rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
MAX_LENGTH = 32
data = load_rotten_tomatoes(load_tokenizer(minilm_path()), MAX_LENGTH, limits=SampleLimits(train=args.rows)).train
torch.manual_seed(0)

model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=2)
if world > 1:
    model = DistributedDataParallel(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
freezer = AutoFreezer(model, optimizer, total_steps=args.steps,  # finds the layers; the package's default policy
                      settings=FreezeConfig(prior=args.prior),
                      cache=CacheConfig(enabled=True), cache_samples=len(data), cache_max_length=MAX_LENGTH)
if rank == 0 and freezer.at_start is not None:  # the prior: what froze before the first step, and why
    print(f"step 0: the first {freezer.at_start['frozen_layers']} layers frozen ({freezer.at_start['at_start']})")
for step in range(args.steps):
    indices = torch.randint(len(data), (16,))[rank::world]  # one seeded draw, this rank's half
    batch = data.get_batch(indices)
    with freezer.serving(indices):  # the frozen layers' output from the cache where every sample has it
        loss = model(input_ids=batch.inputs[0], attention_mask=batch.inputs[1], labels=batch.labels).loss
    loss.backward()
    if (decision := freezer.step()) is not None and rank == 0:  # every rank: after backward, before optimizer.step
        print(f"step {step}: the first {decision['frozen_layers']} layers frozen")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
if rank == 0:
    cache = freezer.cache
    print(f"loss {loss.item():.3f}; {freezer.outcome()}; cache: {cache.hits} served, {cache.computed} computed")
freezer.close()
# checkpoint: {"model": ..., "optimizer": optimizer.state_dict(), "autofreeze": freezer.state_dict()}; to resume,
# freezer.load_state_dict(...) before optimizer.load_state_dict(...)
