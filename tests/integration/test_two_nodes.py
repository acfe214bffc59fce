"""Two torchrun agents on loopback (``--nnodes 2``, one worker each), as on two machines: a 2-stage pipeline
across the "nodes" trains to the same weights as one process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import JOB_TIMEOUT_S, ROOT, assert_close_states, run_job, summary, weights

pytestmark = pytest.mark.slow

TEXT = "tiny_text.yaml"
SETTINGS = ("run.save_model=true", "train.max_steps=4", "checkpoint.enabled=false")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_two_node_pipeline_equals_one_process(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    run_job(TEXT, reference, *SETTINGS)
    run_dir = tmp_path / "two-nodes"
    port = _free_port()
    agents = []
    for node_rank in range(2):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                   "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
                   "-m", "pipetransformer.cli", "train", str(ROOT / "configs" / TEXT), "--set", f"run.dir={run_dir}",
                   "--set", "pipe.enabled=true", "--set", "pipe.stages=2", "--set", "pipe.micro_batches=2"]
        for item in SETTINGS:
            command += ["--set", item]
        agents.append(subprocess.Popen(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [agent.communicate(timeout=JOB_TIMEOUT_S)[0] for agent in agents]
    for agent, output in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, output[-4000:]
    layout = summary(run_dir)["layout_history"][0]
    assert (layout["stages"], layout["dp_width"]) == (2, 1)
    assert summary(run_dir)["world_size"] == 2
    assert_close_states(weights(run_dir), weights(reference), 2e-4, 1e-7)
