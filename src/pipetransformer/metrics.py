"""Per-step timing breakdown and the run directory's JSON files.

The breakdown follows the design notes' logs: data loading, forward, backward, all-reduce, optimizer,
samples/s. Under a pipeline schedule forward and backward interleave, so they are reported together as
``forward_backward_s``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

__all__ = ["StepTimer", "JsonlWriter", "write_json", "device_synchronize"]


def device_synchronize(device: torch.device) -> None:
    """Make wall-clock phases honest on asynchronous devices."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Accumulates seconds per named phase within one step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phases: dict[str, float] = {}
        self._start = time.perf_counter()

    def reset(self) -> None:
        self.phases = {}
        self._start = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            device_synchronize(self.device)
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start

    def total(self) -> float:
        return time.perf_counter() - self._start

    def as_record(self) -> dict[str, float]:
        return {f"{name}_s": round(value, 6) for name, value in self.phases.items()}


class JsonlWriter:
    """Appends one JSON object per line; flushed per record so a killed run keeps what it logged."""

    def __init__(self, path: Path, append: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a" if append else "w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write atomically (temporary name, then rename) so a reader never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)
