"""AdamW kernels on this machine: torch's per-tensor loop (its CPU default), foreach, and fused.

One AdamW step over the packaged MiniLM-L6 with a classification head (22.6 M parameters), random
gradients, one thread (as each of two workers gets on 2 cores). The kernels take turns, the order rotating
every round; medians over all rounds.

    .venv/bin/python benchmarks/optimizer/main.py            # 5 rounds x 10 steps per kernel
    .venv/bin/python benchmarks/optimizer/main.py --quick    # 2 rounds x 5 steps
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from pipetransformer.models import build_model

KERNELS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
THREADS = 1
NUM_LABELS = 2
LEARNING_RATE = 1e-4
WEIGHT_DECAY = 0.01
GRADIENT_SCALE = 1e-3
WARMUP_STEPS = 3
MS_PER_SECOND = 1e3


def time_steps(optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps: a smoke run")
    args = parser.parse_args(argv)
    rounds, steps = (2, 5) if args.quick else (5, 10)
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    params = list(build_model("minilm", num_labels=NUM_LABELS).parameters())
    for param in params:
        param.grad = torch.randn_like(param) * GRADIENT_SCALE
    optimizers = {name: torch.optim.AdamW(params, lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY, **kwargs)
                  for name, kwargs in KERNELS.items()}
    times: dict[str, list[float]] = {name: [] for name in KERNELS}
    for optimizer in optimizers.values():
        time_steps(optimizer, WARMUP_STEPS)
    names = list(KERNELS)
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            times[name] += time_steps(optimizers[name], steps)
    numel = sum(p.numel() for p in params)
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {THREADS} thread, {numel / 1e6:.1f} M parameters, "
          f"load average {os.getloadavg()[0]:.2f}")
    loop = statistics.median(times["loop"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:8s} {median * MS_PER_SECOND:7.1f} ms per step  ({loop / median:.1f}x the loop)")


if __name__ == "__main__":
    main()
