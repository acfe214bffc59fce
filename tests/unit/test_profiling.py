"""``run.profile_steps`` and the step timer's synchronisation: what a profiled run writes, what a bad setting says,
and that a step nobody records times its phases without waiting for the device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipetransformer import metrics
from pipetransformer.config import ConfigError, load_config
from pipetransformer.metrics import StepTimer
from pipetransformer.train.profiling import StepProfiler, host_cost

CPU = torch.device("cpu")


def test_the_profiled_steps_write_an_ops_table_a_trace_and_per_step_counts(tmp_path: Path) -> None:
    profiler = StepProfiler([2, 3], tmp_path, rank=0, device=CPU)
    weights = torch.randn(64, 64, requires_grad=True)
    for step in range(1, 5):
        profiler.before_step(step)
        (weights @ weights).sum().backward()
        profiler.after_step(step)
    profiler.close()
    out = tmp_path / "profile"
    record = json.loads((out / "rank0.json").read_text())
    assert record["steps"] == [2, 3] and record["device"] == "cpu"
    assert record["aten_ops_per_step"] >= 2  # the matmul and the sum, at least, in each of the two steps
    assert record["kernel_launches_per_step"] == record["synchronizing_calls_per_step"] == 0  # no CUDA here
    assert "aten::mm" in (out / "rank0-ops.txt").read_text()
    assert json.loads((out / "rank0-trace.json").read_text())["traceEvents"]


def test_a_run_that_stops_inside_the_profiled_steps_still_writes_them(tmp_path: Path) -> None:
    profiler = StepProfiler([1, 100], tmp_path, rank=1, device=CPU)
    profiler.before_step(1)
    torch.ones(3).sum()
    profiler.after_step(1)
    profiler.close()
    assert json.loads((tmp_path / "profile" / "rank1.json").read_text())["steps"] == [1, 1]


def test_without_profile_steps_nothing_is_profiled_or_written(tmp_path: Path) -> None:
    profiler = StepProfiler(None, tmp_path, rank=0, device=CPU)
    for step in range(1, 3):
        profiler.before_step(step)
        profiler.after_step(step)
    profiler.close()
    assert not (tmp_path / "profile").exists()


class _Event:
    def __init__(self, key: str, count: int) -> None:
        self.key, self.count = key, count


def test_host_cost_counts_launches_and_waits_per_step() -> None:
    events = [_Event("aten::mm", 6), _Event("cudaLaunchKernel", 10), _Event("cudaStreamSynchronize", 2),
              _Event("cudaMemcpyAsync", 4), _Event("ProfilerStep", 2)]
    assert host_cost(events, steps=2) == {"aten_ops_per_step": 3.0, "kernel_launches_per_step": 5.0,
                                          "synchronizing_calls_per_step": 1.0, "async_copies_per_step": 2.0}


@pytest.mark.parametrize("steps", [[0, 3], [5, 2], [1], [1, 2, 3]])
def test_bad_profile_steps_are_refused_in_one_line(steps: list[int]) -> None:
    with pytest.raises(ConfigError, match=r"run.profile_steps must be \[first, last\]"):
        load_config(None, [f"run.profile_steps={json.dumps(steps)}"])


def test_a_step_nobody_records_times_its_phases_without_waiting_for_the_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[torch.device] = []
    monkeypatch.setattr(metrics, "device_synchronize", waits.append)
    timer = StepTimer(CPU)
    timer.reset(synchronize=False)
    with timer.phase("forward"):
        pass
    assert waits == [] and "forward" in timer.phases
    timer.reset(synchronize=True)
    with timer.phase("forward"):
        pass
    assert waits == [CPU]
