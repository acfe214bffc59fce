"""Two torchrun agents on loopback (``--nnodes 2``, one worker each), as on two machines: a 2-stage pipeline
across the "nodes" trains to the same weights as one process, and a checkpoint one node cannot use stops both."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs import JOB_TIMEOUT_S, ROOT, assert_close_states, run_job, summary, weights
from process_group import free_port

pytestmark = pytest.mark.slow

TEXT = "tiny_text.yaml"
SETTINGS = ("run.save_model=true", "train.max_steps=4", "checkpoint.enabled=false")
WORKER_TRACEBACK = re.compile(r"\[rank\d+\]: Traceback")
"""How torch prefixes a worker's uncaught exception, e.g. a lost peer."""


def _two_agents(run_dir: Path, *per_node: tuple[str, ...]) -> list[subprocess.Popen[str]]:
    """Two torchrun agents of one job on loopback, one worker each; ``per_node[i]``: node i's own overrides."""
    port = free_port()
    agents = []
    for node_rank, overrides in enumerate(per_node):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                   "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
                   "-m", "pipetransformer.cli", "train", str(ROOT / "configs" / TEXT), "--set", f"run.dir={run_dir}"]
        for item in overrides:
            command += ["--set", item]
        agents.append(subprocess.Popen(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return agents


def test_two_node_pipeline_equals_one_process(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    run_job(TEXT, reference, *SETTINGS)
    run_dir = tmp_path / "two-nodes"
    pipeline = ("pipe.enabled=true", "pipe.stages=2", "pipe.micro_batches=2", *SETTINGS)
    agents = _two_agents(run_dir, pipeline, pipeline)
    outputs = [agent.communicate(timeout=JOB_TIMEOUT_S)[0] for agent in agents]
    for agent, output in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, output[-4000:]
    layout = summary(run_dir)["layout_history"][0]
    assert (layout["stages"], layout["dp_width"]) == (2, 1)
    assert summary(run_dir)["world_size"] == 2
    assert_close_states(weights(run_dir), weights(reference), 2e-4, 1e-7)


def test_a_checkpoint_only_one_node_cannot_use_fails_every_node_fast_with_its_message(tmp_path: Path) -> None:
    """Node 0 is pointed at a truncated checkpoint, node 1 at a valid one (as when nodes see different storage):
    every worker stops with rank 0's one-line error within seconds, none waits for the collective timeout."""
    valid = tmp_path / "valid"
    run_job(TEXT, valid, "train.max_steps=1")
    checkpoint = next((valid / "checkpoints").glob("step-*"))
    corrupt = tmp_path / "corrupt" / checkpoint.name
    shutil.copytree(checkpoint, corrupt)
    weights_file = corrupt / "weights.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:-100])
    timeout = ("dist.timeout_s=90",)
    started = time.monotonic()
    agents = _two_agents(tmp_path / "resumed", (f"checkpoint.resume={corrupt}", *timeout),
                         (f"checkpoint.resume={checkpoint}", *timeout))
    outputs = [agent.communicate(timeout=JOB_TIMEOUT_S)[0] for agent in agents]
    assert time.monotonic() - started < 60, "a node waited for the collective timeout"
    for agent, output in zip(agents, outputs, strict=True):  # (the agents' own ChildFailedError traceback is torch's)
        assert agent.returncode != 0 and not WORKER_TRACEBACK.search(output), output[-4000:]
    assert f"error: checkpoint {corrupt} is corrupt" in outputs[0], outputs[0][-3000:]
