"""Probe drift: does a layer's output on a fixed batch settle before the run ends (a convergence signal), or does
it move with the learning rate (a schedule in disguise)?

One of the convergence tests the freeze-transfer issue names: the drift of each block's output on a fixed
probe batch between decision windows. One process trains a task's ``ddp`` config exactly as the benchmark does
(same data subset, seed and schedule, nothing frozen) and, at every window (5% of the run, the freeze default's
cadence), runs the probe (the first ``--probe-rows`` validation samples) through the blocks and records, per
block, ``|h_now - h_prev| / |h_prev|`` over the window and ``|h_now - h_0| / |h_0|`` since the start.

    .venv/bin/python benchmarks/freeze_transfer/probe_drift.py --task fashion_mnist   # ~2 min on 2 cores

Writes ``probe_drift-<task>.json`` and a markdown table here. Validation samples only: no test data is read.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from main import transfer_tasks  # noqa: E402 - the benchmark's task definitions, one folder entry

from pipetransformer.config import Config, FreezeConfig, load_config  # noqa: E402
from pipetransformer.data import datasets_from_config  # noqa: E402
from pipetransformer.freeze.policies import window_steps  # noqa: E402
from pipetransformer.models import load_tokenizer, minilm_path  # noqa: E402
from pipetransformer.optim import build_optimizer, layer_lr_scales, lr_at, set_lr  # noqa: E402
from pipetransformer.train.build import build_blocks  # noqa: E402


def block_outputs(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Every block's output on the probe (eval mode, no gradient); text outputs masked to the real tokens."""
    model.eval()
    outputs, activation = [], inputs
    with torch.no_grad():
        for block in range(len(model)):
            activation = model.forward_range(activation, block, block + 1)
            hidden = activation[0].float()
            if len(inputs) == 2 and hidden.dim() == 3:  # text: (hidden, mask): padding carries no signal
                hidden = hidden * inputs[1].unsqueeze(-1)
            outputs.append(hidden.clone())
    model.train()
    return outputs


def relative(now: torch.Tensor, before: torch.Tensor) -> float:
    return float((now - before).norm() / before.norm().clamp_min(1e-12))


def measure(config: Config, probe_rows: int) -> dict:
    torch.manual_seed(config.seed)
    tokenizer = None if config.model.kind == "vit" else load_tokenizer(config.model.path or minilm_path())
    splits = datasets_from_config(config.data, tokenizer)
    pad = config.data.max_length if tokenizer is not None else None
    model = build_blocks(config, splits.train.num_classes, torch.device("cpu"))
    scales = layer_lr_scales(len(model), config.train.layer_lr_decay)
    optimizer = build_optimizer(model.parameters(), config.train,
                                {p: scales[i] for i, block in enumerate(model.blocks) for p in block.parameters()})
    probe = splits.validation.get_batch(list(range(min(probe_rows, len(splits.validation)))), pad_to=pad).inputs
    batch_size = config.train.batch_size
    steps_per_epoch = math.ceil(len(splits.train) / batch_size)
    total_steps = steps_per_epoch * config.train.epochs
    cadence = FreezeConfig()  # the freeze default's decision windows
    window = window_steps(float(cadence.interval), total_steps, cadence.min_window_steps)
    start = previous = block_outputs(model, probe)
    windows, step, began = [], 0, time.perf_counter()
    generator = torch.Generator().manual_seed(config.seed)
    for _ in range(config.train.epochs):
        order = torch.randperm(len(splits.train), generator=generator)
        for first in range(0, len(order), batch_size):
            batch = splits.train.get_batch(order[first:first + batch_size], pad_to=pad)
            lr = lr_at(step, total_steps, config.train)
            set_lr(optimizer, lr)
            loss = torch.nn.functional.cross_entropy(model(*batch.inputs), batch.labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if config.train.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.train.grad_clip)
            optimizer.step()
            step += 1
            if step % window == 0 or step == total_steps:
                now = block_outputs(model, probe)
                windows.append({"step": step, "lr": lr,
                                "window_drift": [relative(n, p) for n, p in zip(now, previous)],
                                "drift_from_start": [relative(n, s) for n, s in zip(now, start)]})
                previous = now
    return {"blocks": model.block_names(), "total_steps": total_steps, "window_steps": window,
            "probe_rows": len(probe[0]), "seconds": time.perf_counter() - began, "windows": windows}


def markdown(task: str, result: dict) -> str:
    blocks = result["blocks"][:-1]  # the head's logits move with every update by design
    lines = [f"### {task}: relative output drift per window ({result['window_steps']} steps of "
             f"{result['total_steps']}; probe {result['probe_rows']} validation samples)", "",
             "| step | lr | " + " | ".join(blocks) + " | lowest / highest layer |",
             "| --- | --- | " + " | ".join("---" for _ in blocks) + " | --- |"]
    for w in result["windows"]:
        drift = w["window_drift"][:len(blocks)]
        lines.append(f"| {w['step']} | {w['lr']:.2e} | " + " | ".join(f"{d:.4f}" for d in drift)
                     + f" | {drift[1] / drift[len(blocks) - 1]:.2f} |")
    last = result["windows"][-1]["drift_from_start"][:len(blocks)]
    lines += ["", "From the start to the end: " + ", ".join(f"{b} {d:.1%}" for b, d in zip(blocks, last)), ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=["fashion_mnist", "rotten_tomatoes"], default="fashion_mnist")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe-rows", type=int, default=64)
    args = parser.parse_args()
    task = transfer_tasks()[args.task]
    config = load_config(task.config("ddp"), [*task.data, f"seed={args.seed}"])
    result = {"task": args.task, "seed": args.seed, **measure(config, args.probe_rows)}
    (HERE / f"probe_drift-{args.task}.json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(args.task, result)
    (HERE / f"probe_drift-{args.task}.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
