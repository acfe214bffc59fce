"""``run.profile_steps``: ``torch.profiler`` over a few training steps, written per rank into the run directory.

Where a step's time goes at the op level, and what it costs the host: per profiled step, how many ops ran, how many
kernels were launched and how many calls made the host wait for the device. On CPU the last two are zero; on a GPU,
where a step takes milliseconds, they are what a fixed per-step cost is made of.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["PROFILE_DIR_NAME", "StepProfiler", "host_cost"]

logger = logging.getLogger(__name__)

PROFILE_DIR_NAME = "profile"
TABLE_ROWS = 40
"""Ops listed in the table, by self time."""
KERNEL_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel")
SYNCHRONIZING = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                 "cudaStreamWaitEvent")
"""Runtime calls after which the host has waited for the device (``cudaMemcpy`` without ``Async`` blocks; so does
a device-to-host ``cudaMemcpyAsync`` that ``.item()`` or ``.cpu()`` waits on, counted apart)."""
DEVICE_TO_HOST = "cudaMemcpyAsync"


def host_cost(events: list[Any], steps: int) -> dict[str, float]:
    """Per step: aten ops, kernel launches and synchronizing runtime calls in a profile's averaged events."""
    counts = {"aten_ops": 0, "kernel_launches": 0, "synchronizing_calls": 0, "async_copies": 0}
    for event in events:
        name, calls = event.key, event.count
        if name.startswith("aten::"):
            counts["aten_ops"] += calls
        elif name in KERNEL_LAUNCHES:
            counts["kernel_launches"] += calls
        elif name in SYNCHRONIZING:
            counts["synchronizing_calls"] += calls
        elif name == DEVICE_TO_HOST:
            counts["async_copies"] += calls
    return {f"{key}_per_step": value / steps for key, value in counts.items()}


class StepProfiler:
    """Profiles steps ``first..last`` (1-based, inclusive) of this rank; nothing when ``steps`` is None.

    Writes ``profile/rank<R>-ops.txt`` (the ops by self time), ``profile/rank<R>-trace.json`` (a Chrome trace:
    chrome://tracing or Perfetto) and ``profile/rank<R>.json`` (the per-step counts of :func:`host_cost`)."""

    def __init__(self, steps: list[int] | None, run_dir: Path, rank: int, device: torch.device) -> None:
        self.first, self.last = (steps[0], steps[1]) if steps else (0, -1)
        self.out = run_dir / PROFILE_DIR_NAME
        self.rank = rank
        self.cuda = device.type == "cuda"
        self._profile: profile | None = None
        self._steps = 0

    def before_step(self, step: int) -> None:
        """``step`` is about to run."""
        if step == self.first and self._profile is None:
            activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if self.cuda else [])]
            self._profile = profile(activities=activities, record_shapes=False)
            self._profile.start()

    def after_step(self, step: int) -> None:
        """``step`` has run."""
        if self._profile is None:
            return
        self._steps += 1
        if step >= self.last:
            self._write()

    def close(self) -> None:
        """The run ended (or stopped) inside the profiled steps: write what was recorded."""
        if self._profile is not None:
            self._write()

    def _write(self) -> None:
        assert self._profile is not None
        self._profile.stop()
        averages = self._profile.key_averages()
        self.out.mkdir(parents=True, exist_ok=True)
        stem = self.out / f"rank{self.rank}"
        sort_by = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        Path(f"{stem}-ops.txt").write_text(averages.table(sort_by=sort_by, row_limit=TABLE_ROWS) + "\n")
        self._profile.export_chrome_trace(f"{stem}-trace.json")
        record: dict[str, Any] = {"steps": [self.first, self.first + self._steps - 1], "device": "cuda" if self.cuda
                                  else "cpu", **host_cost(list(averages), max(self._steps, 1))}
        Path(f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
        logger.info("profile of steps %d-%d written to %s", self.first, self.first + self._steps - 1, self.out)
        self._profile = None
