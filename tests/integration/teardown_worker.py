"""One worker of a 2-worker training job that ends as a user's run ends: ``train()`` returns and the interpreter
exits normally (no ``os._exit``), so whatever the run leaves alive meets the interpreter's finalization.

Usage (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT set as torchrun sets them)::

    python teardown_worker.py RUN_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from pipetransformer.config import load_config
from pipetransformer.train import train

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_vit.yaml"
OVERRIDES = ("train.max_steps=2", "train.epochs=1", "data.max_train_samples=64", "data.max_eval_samples=16",
             "data.max_test_samples=16", "checkpoint.enabled=false")
"""Two data-parallel steps of the tiny ViT: the layout, gradient hooks, optimizer and collectives of a real run."""
THREADS_FILE = "threads_after_run.json"
"""Per rank, the names of this process's native threads once ``train()`` returned (Linux): gloo's must be gone."""
TASKS = Path("/proc/self/task")


def thread_names() -> list[str]:
    return sorted((task / "comm").read_text().strip() for task in TASKS.iterdir())



if __name__ == "__main__":
    run_dir = Path(sys.argv[1])
    train(load_config(CONFIG, [f"run.dir={run_dir}", *OVERRIDES]))
    if TASKS.is_dir():
        (run_dir / f"rank{os.environ['RANK']}-{THREADS_FILE}").write_text(json.dumps(thread_names()))
