"""`pipetransformer plan` profiles blocks as a worker of the run would: with the threads each local worker gets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pipetransformer.config import DistConfig, load_config
from pipetransformer.distributed import worker_threads
from pipetransformer.plan.command import profiled_costs

TINY_VIT = Path(__file__).resolve().parents[2] / "configs" / "tiny_vit.yaml"


def test_a_worker_gets_its_share_of_the_cores_unless_told() -> None:
    cores = os.cpu_count() or 1
    assert worker_threads(DistConfig(), 1) == cores
    assert worker_threads(DistConfig(), cores) == 1
    assert worker_threads(DistConfig(), 4 * cores) == 1, "never fewer than one thread"
    assert worker_threads(DistConfig(threads_per_worker=3), 2) == 3


def test_profiling_for_a_plan_leaves_the_callers_threads_alone() -> None:
    config = load_config(TINY_VIT, ["pipe.profile=true"])
    before = torch.get_num_threads()
    costs, work, names = profiled_costs(config, local_workers=2)
    assert torch.get_num_threads() == before
    assert len(costs) == len(work) == len(names) and all(min(c.seconds(1)) > 0 for c in costs)


@pytest.mark.cuda(devices=1)
def test_a_plan_for_a_cuda_run_profiles_on_the_device() -> None:
    """Workers profile on their device; the plan's costs must come from there too, not from this host's CPU."""
    config = load_config(TINY_VIT, ["pipe.profile=true", "dist.device=cuda"])
    torch.cuda.reset_peak_memory_stats()
    costs, _, _ = profiled_costs(config, local_workers=1)
    assert torch.cuda.max_memory_allocated() > sum(c.param_bytes for c in costs)
