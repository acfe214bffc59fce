"""Per-step timing breakdown and the run directory's metrics: JSON files and TensorBoard event files.

The breakdown says where a step's time goes: data loading, forward, backward, all-reduce, control,
optimizer, samples/s. Under a pipeline schedule forward and backward interleave, so they are reported together as
``forward_backward_s``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

__all__ = ["StepTimer", "JsonlWriter", "MetricsLog", "write_json", "device_synchronize", "eval_metric",
           "tensorboard_available", "tensorboard_scalars", "truncate_log", "METRICS_FILE", "TENSORBOARD_DIR_NAME",
           "LAYOUT_FIELDS", "NON_PHASE_SECONDS", "CACHE_FIELD_PREFIX", "DEFAULT_EVAL_METRIC", "peak_rss_bytes"]

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TEST_SAMPLES_FILE = "test_samples.json"  # the test metric per sample, in the test split's order
TENSORBOARD_DIR_NAME = "tensorboard"
# Fields of a step record that describe the layout it ran under, with their plot titles.
LAYOUT_FIELDS = (("frozen_layers", "frozen layers"), ("stages", "pipeline stages"),
                 ("dp_width", "data-parallel width"), ("micro_batches", "micro-batches"))
NON_PHASE_SECONDS = ("step_s", "wall_s", "samples_per_s")  # end in "_s" but are no phase
CACHE_FIELD_PREFIX = "cache_"
NOT_SCALARS = ("event", "step", "epoch", "wall_s")  # a step record's keys that are its coordinates, not metrics
EVAL_COORDINATES = (*NOT_SCALARS, "split", "samples")  # an evaluation record's keys besides its task's metric
DEFAULT_EVAL_METRIC = "accuracy"  # classification's, what a run without evaluations is read as


RUSAGE_MAXRSS_UNIT = 1024  # Linux reports ru_maxrss in KiB


def peak_rss_bytes() -> int:
    """This process's peak resident host memory so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * RUSAGE_MAXRSS_UNIT


def device_synchronize(device: torch.device) -> None:
    """Make wall-clock phases honest on asynchronous devices."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Accumulates seconds per named phase within one step.

    On an asynchronous device a phase's time is only honest after a synchronize, which stalls the host; so a step
    whose phases nobody records (``reset(synchronize=False)``: not a logging step) times its phases without one."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phases: dict[str, float] = {}
        self.synchronize = True
        self._start = time.perf_counter()

    def reset(self, synchronize: bool = True) -> None:
        self.phases = {}
        self.synchronize = synchronize
        self._start = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.synchronize:
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


def truncate_log(path: Path, step: int) -> None:
    """Cut a JSON-lines log back to what it held when the checkpoint of ``step`` was written, so a run resumed
    from it logs each later step once: after that step's ``checkpoint`` record if there is one (metrics), else
    before the first record of a later step (sample logs); a torn last line goes too."""
    if not path.exists():
        return
    offset, keep = 0, None
    with path.open("rb") as log:
        for line in log:
            try:
                record = json.loads(line)
            except ValueError:
                keep = offset if keep is None else keep
                break
            if record.get("event") == "checkpoint" and record.get("step") == step:
                keep = offset + len(line)
            elif record.get("step", step) > step:
                keep = offset if keep is None else keep
                break
            offset += len(line)
    os.truncate(path, offset if keep is None else keep)


def write_json(path: Path, payload: dict[str, Any], indent: int | None = 2) -> None:
    """Write atomically (temporary name, then rename) so a reader never sees half a file; ``indent=None`` keeps
    long lists of numbers on one line."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=indent, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)


def tensorboard_available() -> bool:
    """Whether the optional ``tensorboard`` package (``pip install '.[tensorboard]'``) is installed."""
    return importlib.util.find_spec("tensorboard") is not None


def eval_metric(evals: list[dict[str, Any]]) -> str:
    """The name of the task's metric in evaluation records (``accuracy`` for classification)."""
    for key in evals[0] if evals else ():
        if key not in EVAL_COORDINATES:
            return key
    return DEFAULT_EVAL_METRIC


def tensorboard_scalars(record: dict[str, Any]) -> list[tuple[str, float]]:
    """The TensorBoard scalars ``(tag, value)`` of one metrics record, at the record's ``step``.

    Step records give ``layout/*`` (frozen layers, stages, width, micro-batches), ``time/*`` (the step and
    its phases, seconds) and ``train/*`` (loss, lr, samples/s, cache, ...); evaluations ``eval/<metric>``
    (``eval/accuracy`` for classification); freeze decisions ``freeze/frozen_layers``. Other events
    (checkpoints) and non-numbers give nothing.
    """
    event = record.get("event")
    if event == "eval":
        metric = eval_metric([record])
        return [(f"eval/{metric}", float(record[metric]))]
    if event == "freeze":
        return [("freeze/frozen_layers", float(len(record.get("frozen", []))))]
    if event != "step":
        return []
    layout = dict(LAYOUT_FIELDS)
    scalars = []
    for key, value in record.items():
        if key in NOT_SCALARS or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        seconds = key == "step_s" or (key.endswith("_s") and key not in NON_PHASE_SECONDS
                                      and not key.startswith(CACHE_FIELD_PREFIX))
        group = "layout" if key in layout else "time" if seconds else "train"
        scalars.append((f"{group}/{key}", float(value)))
    return scalars


class MetricsLog:
    """Rank 0's log of a run: ``metrics.jsonl`` (the record every tool reads) and, when ``tensorboard`` is on
    and the package is installed, the same records as TensorBoard scalars in ``<run dir>/tensorboard``.

    ``next_step`` is the first step this process will log. TensorBoard drops every event of an earlier
    process at or after it (its ``purge_step``) and an appended ``metrics.jsonl`` is cut after the checkpoint
    of the step before it (:func:`truncate_log`), so a resumed run's logs hold each step once: the killed
    run's up to the checkpoint, then this run's. The trainer calls ``flush`` at every checkpoint so
    that the history up to it is on disk even if the process is then killed (TensorBoard's writer thread
    appends events to a local file as it takes them from its queue; ``flush`` waits for that queue, and for
    file systems that buffer whole files).
    """

    def __init__(self, run_dir: Path, *, append: bool, tensorboard: bool, next_step: int) -> None:
        if append:
            truncate_log(run_dir / METRICS_FILE, next_step - 1)
        self._jsonl = JsonlWriter(run_dir / METRICS_FILE, append)
        self._events: Any = None
        if tensorboard and tensorboard_available():
            from torch.utils.tensorboard import SummaryWriter
            self._events = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR_NAME), purge_step=next_step)
        elif tensorboard:
            logger.info("tensorboard is not installed: no event files (pip install '.[tensorboard]' for them)")

    def write(self, record: dict[str, Any]) -> None:
        self._jsonl.write(record)
        if self._events is not None:
            for tag, value in tensorboard_scalars(record):
                self._events.add_scalar(tag, value, global_step=record["step"])

    def flush(self) -> None:
        """Put the buffered event files on disk (the JSON lines already are)."""
        if self._events is not None:
            self._events.flush()

    def close(self) -> None:
        self._jsonl.close()
        if self._events is not None:
            self._events.close()
