"""A whole run, predicted: the layout PipeTransformer follows as layers freeze, against a static baseline.

A freeze timeline (how many leading layers are frozen from which point of training on) cuts the run
into phases; each phase gets its own lever choice (:func:`~pipetransformer.plan.levers.choose_levers`).
With the cache on, the epoch after a freeze still runs the newly frozen layers forward once per sample
(the cache advances each entry through them at its next visit) and only then serves the whole prefix.
The static baseline (Pipe + DDP, nothing frozen, nothing cached) runs one layout throughout; the
speed-up is the baseline's time over the sum of the phases' times for the same samples.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipetransformer.freeze.policies import GeometricPolicy, frozen_blocks, frozen_prefix_layers
from pipetransformer.pipe.cost import BlockCost, Precision
from pipetransformer.plan.cluster import Cluster, read_json_file
from pipetransformer.plan.levers import LeverChoice, LeverSettings, NoLayoutError, choose_levers

__all__ = [
    "BatchPolicy",
    "FreezePoint",
    "Phase",
    "RunPlan",
    "TimelineError",
    "geometric_timeline",
    "plan_run",
    "read_timeline",
    "timeline_from_summary",
]

SUMMARY_FILE = "summary.json"
_EPSILON = 1e-9


class TimelineError(ValueError):
    """A freeze timeline that cannot be used; the message says what to change."""


@dataclass(frozen=True)
class FreezePoint:
    """From ``at`` (fraction of the run's samples) on, the first ``frozen_layers`` layers are frozen."""

    at: float
    frozen_layers: int


def geometric_timeline(num_layers: int, *, alpha: float, max_fraction: float | None, epochs: float,
                       every_epochs: float) -> list[FreezePoint]:
    """The geometric schedule the trainer's ``geometric`` policy follows (and the ``gradient`` policy is
    bounded by): a decision every ``every_epochs`` epochs of an ``epochs``-epoch run."""
    if epochs <= 0 or every_epochs <= 0:
        raise TimelineError(f"epochs and the freeze interval must be > 0, got {epochs} and {every_epochs}")
    policy = GeometricPolicy(num_layers, interval=1, interval_unit="steps", max_fraction=max_fraction, alpha=alpha)
    points = [FreezePoint(0.0, 0)]
    decision = 1
    while decision * every_epochs < epochs - _EPSILON:
        frozen = policy.decide(step=decision, epoch=0, epoch_end=False)
        if frozen is not None:
            points.append(FreezePoint(decision * every_epochs / epochs, len(frozen.frozen)))
        decision += 1
    return points


def timeline_from_summary(summary: Mapping[str, Any], source: str = SUMMARY_FILE) -> list[FreezePoint]:
    """The freeze decisions a finished run took (``freeze_decisions`` of its ``summary.json``), placed at
    their step's fraction of the run's steps (exact when the global batch stays fixed)."""
    steps = summary.get("steps")
    decisions = summary.get("freeze_decisions")
    if not isinstance(steps, int) or steps < 1 or not isinstance(decisions, list):
        raise TimelineError(f"{source}: no 'steps' and 'freeze_decisions': pass the summary.json of a finished run")
    points = [FreezePoint(0.0, 0)]
    for decision in decisions:
        if not isinstance(decision, dict) or not isinstance(decision.get("step"), int):
            raise TimelineError(f"{source}: a freeze decision without a step ({decision!r}): pass the summary.json "
                                "of a finished run")
        frozen = frozen_prefix_layers(decision.get("frozen", []))
        if frozen > points[-1].frozen_layers:
            points.append(FreezePoint(min(1.0, decision["step"] / steps), frozen))
    return points


def read_timeline(path: Path) -> list[FreezePoint]:
    """The timeline of a run directory or of its ``summary.json``."""
    file = path / SUMMARY_FILE if path.is_dir() else path
    summary = read_json_file(file, TimelineError, f"--freeze {path}: no {SUMMARY_FILE} there: give a finished run's "
                             "directory, its summary.json, or 'geometric'")
    return timeline_from_summary(summary, str(file))


@dataclass(frozen=True)
class BatchPolicy:
    """Each replica's batch as replicas come and go.

    ``per_pipeline``: every replica always trains on this many samples per step (the paper's runs: the
    global batch grows with the replicas). Otherwise ``global_batch`` is the global batch at the run's
    first width and ``keep_per_pipeline`` says whether each replica keeps its first batch
    (``dp.batch_policy``), as the trainer does.
    """

    global_batch: int
    keep_per_pipeline: bool = False
    per_pipeline: int | None = None

    def replica_batch(self, replicas: int, initial_replicas: int | None) -> int:
        if self.per_pipeline is not None:
            return self.per_pipeline
        if self.keep_per_pipeline and initial_replicas:
            return self.global_batch // initial_replicas
        return self.global_batch // replicas


@dataclass(frozen=True)
class Phase:
    """A stretch of the run with one freeze state and one layout; ``cached_blocks`` are those the cache
    serves, ``filling`` says some frozen ones still run forward (the epoch after a freeze)."""

    start: float
    end: float
    frozen_layers: int
    frozen_blocks: int
    cached_blocks: int
    filling: bool
    choice: LeverChoice

    @property
    def samples_per_s(self) -> float:
        return self.choice.chosen.samples_per_s

    @property
    def relative_time(self) -> float:
        """Seconds per training sample of the whole run spent in this phase."""
        return (self.end - self.start) / self.samples_per_s

    def describe(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "frozen_layers": self.frozen_layers,
                "frozen_blocks": self.frozen_blocks, "cached_blocks": self.cached_blocks, "filling": self.filling,
                **self.choice.chosen.describe(),
                "alternatives": [c.describe() | {"label": c.label()} for c in self.choice.rejected]}


@dataclass(frozen=True)
class RunPlan:
    phases: list[Phase]
    baseline: LeverChoice

    @property
    def relative_time(self) -> float:
        return sum(phase.relative_time for phase in self.phases)

    @property
    def baseline_relative_time(self) -> float:
        return 1.0 / self.baseline.chosen.samples_per_s

    @property
    def speedup(self) -> float:
        return self.baseline_relative_time / self.relative_time

    def describe(self) -> dict[str, Any]:
        return {"phases": [phase.describe() for phase in self.phases],
                "baseline": self.baseline.chosen.describe() | {"label": self.baseline.chosen.label()},
                "speedup": self.speedup,
                "average_samples_per_s": 1.0 / self.relative_time}


def _validated(timeline: Sequence[FreezePoint], num_layers: int) -> list[FreezePoint]:
    points = sorted(timeline, key=lambda p: p.at)
    if not points or points[0].at > _EPSILON:
        points = [FreezePoint(0.0, 0), *points]
    for point in points:
        if not 0.0 <= point.at <= 1.0 or not 0 <= point.frozen_layers <= num_layers:
            raise TimelineError(f"freeze point {point}: 'at' must be in [0, 1] and frozen_layers in 0..{num_layers}")
    if any(b.frozen_layers < a.frozen_layers for a, b in zip(points, points[1:], strict=False)):
        raise TimelineError("frozen layers never thaw: the freeze timeline must not decrease")
    return points


def _frozen_layers_at(points: Sequence[FreezePoint], at: float) -> int:
    """Frozen layers at ``at``; none before the run starts."""
    return max((p.frozen_layers for p in points if p.at <= at + _EPSILON), default=0) if at >= -_EPSILON else 0


def plan_run(costs: Mapping[Precision, Sequence[BlockCost] | None], cluster: Cluster, *, num_layers: int,
             timeline: Sequence[FreezePoint], epochs: float, batch: BatchPolicy, settings: LeverSettings,
             baseline_settings: LeverSettings, cache: bool = True, cache_min_frozen: int = 1,
             advance_cache: bool = True, unfrozen_settings: LeverSettings | None = None) -> RunPlan:
    """Every phase's layout and predicted samples/s, and the static baseline's.

    A sample's cache entry is as old as its last visit, one epoch earlier: at ``t`` the cache serves the
    prefix frozen at ``t - 1 epoch`` and the layers frozen since run forward (the trainer advances the
    entry through them). So phases break at every freeze and one epoch after it.
    ``advance_cache=False``: an entry older than the latest freeze is rebuilt through the whole frozen
    prefix instead. ``unfrozen_settings``: the levers while nothing is frozen (default ``settings``),
    e.g. to start from the baseline's layout.
    """
    if epochs <= 0:
        raise TimelineError(f"epochs must be > 0, got {epochs}")
    points = _validated(timeline, num_layers)
    epoch = 1.0 / epochs
    breaks = sorted({0.0, 1.0, *(p.at for p in points), *(p.at + epoch for p in points if p.at + epoch < 1.0)})
    initial: list[int] = []

    def cached_blocks_at(at: float) -> int:
        layers = _frozen_layers_at(points, at)
        return len(frozen_blocks(range(layers), num_layers)) if cache and layers >= cache_min_frozen else 0

    def choose(frozen: int, cached: int, lever_settings: LeverSettings) -> LeverChoice:
        return choose_levers(costs, cluster, frozen_blocks=frozen, cached_blocks=cached, settings=lever_settings,
                             replica_batch=lambda r: batch.replica_batch(r, initial[0] if initial else None))

    phases: list[Phase] = []
    for start, end in zip(breaks, breaks[1:], strict=False):
        if end - start <= _EPSILON:
            continue
        layers = _frozen_layers_at(points, start)
        frozen = len(frozen_blocks(range(layers), num_layers))
        now, visited = cached_blocks_at(start), cached_blocks_at(start - epoch)
        served = visited if advance_cache or visited == now else 0
        if phases and (phases[-1].frozen_layers, phases[-1].cached_blocks) == (layers, served):
            phases[-1] = replace(phases[-1], end=end)
            continue
        phase_settings = settings if layers or unfrozen_settings is None else unfrozen_settings
        phases.append(Phase(start, end, layers, frozen, served, served < now, choose(frozen, served, phase_settings)))
        if not initial:
            initial.append(phases[0].choice.chosen.replicas)
    try:
        baseline = choose_levers(costs, cluster, frozen_blocks=0, cached_blocks=0, settings=baseline_settings,
                                 replica_batch=lambda r: batch.replica_batch(r, None))
    except NoLayoutError as error:
        raise NoLayoutError(f"the static baseline (fp32, no recomputation) fits nowhere, so there is nothing to "
                            f"compare with: {error.reasons}; raise the memory budget or use more devices",
                            error.reasons) from None
    return RunPlan(phases, baseline)
