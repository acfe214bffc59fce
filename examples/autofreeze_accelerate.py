"""AutoFreeze in an Accelerate loop: MiniLM fine-tuned on Rotten Tomatoes snippets with gradient accumulation, the
frozen layers' output served from the activation cache once they freeze.

    .venv/bin/python examples/autofreeze_accelerate.py [--steps 150]
    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 examples/autofreeze_accelerate.py
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, get_linear_schedule_with_warmup

from pipetransformer.config import CacheConfig, FreezeConfig
from pipetransformer.data import SampleLimits, load_rotten_tomatoes
from pipetransformer.integrations import AutoFreezer
from pipetransformer.models.hf import load_tokenizer, minilm_path

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=150, help="optimizer steps")
parser.add_argument("--rows", type=int, default=2000, help="training snippets")
parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
parser.add_argument("--cpu", action=argparse.BooleanOptionalAction, default=not torch.cuda.is_available(),
                    help="Accelerate's own switch: processes on CPU (gloo) rather than one accelerator each")
parser.add_argument("--prior", default="none", type=lambda value: int(value) if value.isdigit() else value,
                    help="frozen before any evidence: none (the default), auto, embeddings or a layer count")
args = parser.parse_args()
accelerator = Accelerator(gradient_accumulation_steps=args.accumulation, cpu=args.cpu)
MAX_LENGTH = 32
data = load_rotten_tomatoes(load_tokenizer(minilm_path()), MAX_LENGTH, limits=SampleLimits(train=args.rows)).train
torch.manual_seed(0)  # the classification head, drawn by from_pretrained: the same on every process and run

model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=2)
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
# items are (index, (input_ids, attention_mask), label): the index keys the activation cache
loader = DataLoader(data, batch_size=8, shuffle=True, drop_last=True)
# Accelerate steps a prepared schedule once per process at each optimizer step, so its length counts them all
schedule = get_linear_schedule_with_warmup(optimizer, args.steps // 10, args.steps * accelerator.num_processes)
model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
freezer = AutoFreezer(model, optimizer, total_steps=args.steps,  # finds the layers; the package's default policy
                      settings=FreezeConfig(prior=args.prior),
                      cache=CacheConfig(enabled=True), cache_samples=len(data), cache_max_length=MAX_LENGTH)
if freezer.at_start is not None:  # the prior: what froze before the first step, and why
    accelerator.print(f"step 0: the first {freezer.at_start['frozen_layers']} layers frozen "
                      f"({freezer.at_start['at_start']})")
step = 0
while step < args.steps:
    for indices, (input_ids, attention_mask), labels in loader:
        with accelerator.accumulate(model):
            with freezer.serving(indices):  # the frozen layers' output from the cache where every sample has it
                loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            accelerator.backward(loss)
            decision = freezer.step()  # every micro-batch, like optimizer.step: it acts when the optimizer does
            if decision is not None:
                accelerator.print(f"step {step}: the first {decision['frozen_layers']} layers frozen")
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
        step += accelerator.sync_gradients
        if step == args.steps:
            break
cache = freezer.cache
accelerator.print(f"loss {loss.item():.3f}; {freezer.outcome()}; cache: {cache.hits} served, {cache.computed} computed")
freezer.close()
