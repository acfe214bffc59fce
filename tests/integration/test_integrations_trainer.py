"""AutoFreezeCallback inside the Hugging Face Trainer on 2 gloo processes under torchrun: MiniLM fine-tuned on
Rotten Tomatoes snippets, layers freeze mid-run with the coherence policy (short windows), DDP keeps working, the
frozen gradients leave the all-reduce (counted by a comm hook), and loss and accuracy are recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STEPS = 30
TIMEOUT_S = 300
DDP_ERROR = "Expected to have finished reduction"


def test_the_trainer_callback_freezes_under_torchrun_and_leaves_frozen_grads_out_of_the_all_reduce(
        tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(HERE), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(HERE / "hf_trainer_worker.py"), str(tmp_path), "--steps", str(STEPS)]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-5000:]
    assert DDP_ERROR not in run.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    decisions = result["decisions"]
    assert decisions, f"nothing froze; the last windows' coherence: {result['coherence']}"
    first = decisions[0]["global_step"]  # decided before the update of step first + 1 (1-based)
    assert 0 < first < STEPS - 1
    frozen = decisions[-1]["frozen_layers"]
    assert 1 <= frozen <= 2  # max_fraction 1/3 of 6 layers
    reduced = result["reduced_per_step"]
    assert len(reduced) == STEPS
    assert reduced[:first + 1] == [result["parameters"]] * (first + 1)
    assert reduced[-1] == result["trainable"] < result["parameters"]
    assert result["optimized"] == result["with_state"] == result["trainable"]  # frozen: out of the optimizer too
    assert result["training_modes"] == [False] * frozen + [True] * (6 - frozen)
    history = result["log_history"]
    assert any(entry.get("autofreeze/frozen_layers") == decisions[0]["frozen_layers"] for entry in history)
    losses = [entry["loss"] for entry in history if "loss" in entry]
    assert len(losses) == STEPS // 5 and all(0 < loss < 1.0 for loss in losses)
    assert 0.0 <= result["eval"]["eval_accuracy"] <= 1.0 and result["eval"]["eval_loss"] > 0
