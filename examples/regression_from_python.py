"""Bring your own task through the Python API: predict a digit's value (a number, not a class) from its 8x8 image,
on 2 local workers with all four automations on; nothing in the trainer changes, the task is passed in.

    .venv/bin/python examples/regression_from_python.py [RUN_DIR]

``pipetransformer.train.regression()`` is one output, float targets, squared error as the loss and mean
absolute error (``mae``) as the metric; write your own ``Task`` the same way for other heads.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch.multiprocessing as mp

from pipetransformer.config import load_config
from pipetransformer.train import regression, train

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny_vit.yaml"
WORKERS = 2
LOOPBACK = "127.0.0.1"
OVERRIDES = [
    # a number is harder to learn than a class: 1,200 training images, 12 epochs (~900 steps, ~20 s)
    "data.max_train_samples=1200", "train.epochs=12", "train.eval_every_steps=100",
    # AutoFreeze: a geometric third of the active layers every 200 steps, up to half (the default cap is a third)
    "freeze.enabled=true", "freeze.policy=geometric", "freeze.interval=200", "freeze.interval_unit=steps",
    "freeze.max_fraction=0.5",
    # AutoPipe + AutoDP: a memory budget that starts as a 2-stage pipeline and compresses once 2 layers froze
    "pipe.enabled=true", "dp.enabled=true", "pipe.device_memory_gb=0.008",
    "cache.enabled=true",  # AutoCache
]


def worker(rank: int, port: int, run_dir: str) -> None:
    """One of the workers: what torchrun would set, then the Python API."""
    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORKERS), LOCAL_WORLD_SIZE=str(WORKERS))
    summary = train(load_config(CONFIG, [*OVERRIDES, f"run.dir={run_dir}"]), task=regression())
    if rank == 0:
        shown = ("eval_mae", "best_eval_mae", "test_mae", "test_mae_at_best_validation", "steps", "run_dir")
        print(json.dumps({key: summary[key] for key in shown}, indent=2))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


if __name__ == "__main__":
    run_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="regression-")
    mp.spawn(worker, args=(free_port(), run_dir), nprocs=WORKERS, join=True)
