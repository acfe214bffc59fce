"""AutoFreezeCallback inside the Hugging Face Trainer on 2 gloo processes under torchrun: MiniLM fine-tuned on
Rotten Tomatoes snippets, layers freeze mid-run with the coherence policy (short windows), DDP keeps working, the
frozen gradients leave the all-reduce (counted by a comm hook) and the optimizer, loss and accuracy are recorded;
a run resumed from a checkpoint taken after the freeze keeps the frozen boundary and the optimizer state; and a run
serving the frozen layers from the activation cache trains exactly as a plain one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
WORLD = 2
ROOT = HERE.parents[1]
STEPS = 30
CHECKPOINT_AT = 20
LOGGING_STEPS = 5
LAYERS = 6
TIMEOUT_S = 300
DDP_ERROR = "Expected to have finished reduction"
FROZEN = "autofreeze/frozen_layers"  # the callback's key in the Trainer's log


def _launch(out: Path, worker: str, *options: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(HERE), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
               str(HERE / worker), str(out), *options]
    run = subprocess.run(command, cwd=out, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-5000:]
    assert DDP_ERROR not in run.stderr


def _torchrun(out: Path, *options: str) -> dict[str, Any]:
    _launch(out, "hf_trainer_worker.py", "--steps", str(STEPS), *options)
    result_file = options[options.index("--result") + 1]
    result: dict[str, Any] = json.loads((out / result_file).read_text())
    return result


def test_the_trainer_callback_freezes_under_torchrun_and_a_resumed_run_keeps_the_boundary(tmp_path: Path) -> None:
    result = _torchrun(tmp_path, "--save-steps", str(CHECKPOINT_AT), "--result", "whole.json")
    # pretrained weights: the prior froze the embeddings and a third of the layers before the first step, recorded
    # at step 0 (out of the all-reduce from the start); the evidence's decisions follow
    at_start, *decisions = result["decisions"]
    assert at_start["global_step"] == 0 and at_start["frozen_layers"] == LAYERS // 3, at_start
    assert "freeze.prior: auto, pretrained weights" in at_start["at_start"]
    assert decisions, f"nothing froze; the last windows' coherence: {result['coherence']}"
    first = decisions[0]["global_step"]  # decided before the update of step first + 1 (1-based)
    assert 0 < first < CHECKPOINT_AT - 1
    frozen = decisions[-1]["frozen_layers"]
    assert 1 <= frozen < LAYERS
    reduced = result["reduced_per_step"]
    assert len(reduced) == STEPS
    assert result["prior_layers"] == LAYERS // 3
    assert reduced[:first + 1] == [result["parameters"] - result["prior_frozen"]] * (first + 1)
    # each decision shrinks the next step's all-reduce (one decided at the last step has no next step)
    assert reduced == sorted(reduced, reverse=True) and reduced[first + 1] < reduced[first]
    assert len(set(reduced)) == 1 + len([d for d in decisions if d["global_step"] < STEPS - 1])
    assert result["trainable"] <= reduced[-1]
    assert result["optimized"] == result["with_state"] == result["trainable"]  # frozen: out of the optimizer too
    assert result["training_modes"] == [False] * frozen + [True] * (LAYERS - frozen)
    history = result["log_history"]
    logged = [(entry["step"], entry[FROZEN]) for entry in history if FROZEN in entry]
    assert logged == [(d["global_step"], d["frozen_layers"]) for d in (at_start, *decisions)]
    losses = [entry["loss"] for entry in history if "loss" in entry]
    assert len(losses) == STEPS // LOGGING_STEPS and all(0 < loss < 1.0 for loss in losses)
    assert 0.0 <= result["eval"]["eval_accuracy"] <= 1.0 and result["eval"]["eval_loss"] > 0

    checkpoint = tmp_path / "trainer" / f"checkpoint-{CHECKPOINT_AT}"
    resumed = _torchrun(tmp_path, "--resume", str(checkpoint), "--result", "resumed.json")
    assert resumed["restored_state_equal"] is True and resumed["restored_tensors"] > 0
    # the boundary came from the checkpoint: the first resumed step all-reduces what step CHECKPOINT_AT + 1 did
    assert len(resumed["reduced_per_step"]) == STEPS - CHECKPOINT_AT
    assert resumed["reduced_per_step"][0] == reduced[CHECKPOINT_AT]
    assert all(d["global_step"] >= CHECKPOINT_AT for d in resumed["decisions"])
    assert resumed["optimized"] == resumed["with_state"] == resumed["trainable"]


def test_the_trainer_serves_the_frozen_layers_from_one_store_per_node_and_trains_as_without_it(
        tmp_path: Path) -> None:
    rows, epochs, per_device_batch = 128, 3, 8
    _launch(tmp_path, "hf_trainer_cache_worker.py", "--rows", str(rows), "--epochs", str(epochs))
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    steps = rows // (per_device_batch * WORLD) * epochs
    for rank, result in enumerate(results):
        # epoch 1 records each rank's half; from epoch 2 the sampler deals each rank samples the other one
        # recorded too, and all are served: the ranks share the node's store
        assert result["cached"]["counts"] == [rows // WORLD, 0, rows // WORLD * (epochs - 1)], f"rank {rank}"
        assert len(result["plain"]["losses"]) == steps
        # rows padded alike every epoch: a served batch is the computed one bit for bit, so is the whole run
        assert result["cached"]["losses"] == result["plain"]["losses"], f"rank {rank}"
