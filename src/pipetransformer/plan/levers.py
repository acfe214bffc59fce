"""Fitting the active blocks into device memory by the fastest mix of levers, for one freeze state.

Three levers make a model fit: more pipeline stages (fewer blocks per device), recomputation of chosen
blocks (activation checkpointing: only their input is kept), and bf16 activations. Each costs speed in
its own way (bubble and messages, one more forward, nothing but numerics), and fewer stages leave more
devices for replicas. So every stage count dividing the world and every allowed precision is tried with
the least recomputation that fits, each candidate's step is simulated (:mod:`.simulate`, all-reduce over
the cluster's links included), and the one with the most samples/s *of the whole world*
(replicas x replica batch / step) wins. The rest are returned with the reason they lost, which is what
``pipetransformer plan`` prints. Pure: re-run it at every freeze, as frozen blocks free memory
(recomputation then goes before stages do).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pipetransformer.pipe.cost import ADAMW_STATE_FACTOR, BlockCost, BlockState, Precision, block_states, recomputed
from pipetransformer.pipe.layout import valid_stage_counts
from pipetransformer.pipe.partition import (
    DEFAULT_MAX_MICRO_BATCH_FACTOR,
    Partition,
    PartitionError,
    micro_batch_candidates,
    partition,
    predict_step_time,
    readable_bytes,
)
from pipetransformer.plan.cluster import Cluster, local_cluster
from pipetransformer.plan.simulate import StepSimulation, SyncGroup, simulate_step, stage_works

__all__ = [
    "GRADIENT_BUCKET_BYTES",
    "Candidate",
    "LeverChoice",
    "LeverSettings",
    "NoLayoutError",
    "choose_levers",
    "fastest_local_fit",
    "recompute_set",
    "simulate_layout",
]

GRADIENT_BUCKET_BYTES = 25 * 1024 * 1024
"""The trainer's gradient bucket (``pipetransformer.dp.sync.DEFAULT_BUCKET_BYTES``, DDP's default)."""

INTER_NODE = "inter-node network"


class NoLayoutError(PartitionError):
    """No combination of the allowed levers fits; ``reasons`` lists each candidate's."""

    def __init__(self, message: str, reasons: str) -> None:
        super().__init__(message)
        self.reasons = reasons


@dataclass(frozen=True)
class LeverSettings:
    """What the planner may choose and under which constraints.

    ``micro_batches``: a fixed count for pipelines (one stage runs its batch whole, as the trainer does),
    a count per stage count (the stage counts it lacks are chosen), or None to choose it.
    ``stage_counts``: None for every divisor of
    the world size. ``overlap_pipelined_allreduce``: whether gradient buckets of a multi-stage pipeline
    start during the last backward (DDP's hooks around a whole pipeline do; this project's trainer
    overlaps only without a pipeline, see ``pipetransformer.dp.sync``). ``touched_rows_only``: vocabulary tables
    are all-reduced by the rows the step's samples touch (``dp.touched_rows_only``), not whole.
    """

    memory_budget_bytes: float
    schedule: str = "gpipe"
    micro_batches: int | Mapping[int, int] | None = None
    precisions: tuple[Precision, ...] = (Precision.FP32,)
    recompute: bool = False
    stage_counts: tuple[int, ...] | None = None
    optimizer_state_factor: int = ADAMW_STATE_FACTOR
    bucket_bytes: int = GRADIENT_BUCKET_BYTES
    overlap_pipelined_allreduce: bool = False
    max_micro_batch_factor: int = DEFAULT_MAX_MICRO_BATCH_FACTOR
    touched_rows_only: bool = True


@dataclass(frozen=True)
class Candidate:
    """One combination of levers and what it is predicted to do; ``reason`` says why it was not chosen."""

    stages: int
    replicas: int
    precision: Precision
    recomputed: tuple[int, ...] = ()
    micro_batches: int = 0
    replica_batch: int = 0
    partition: Partition | None = None
    simulation: StepSimulation | None = None
    reason: str = ""

    @property
    def samples_per_s(self) -> float:
        """Samples per second of the whole world: every replica's batch per simulated step."""
        if self.simulation is None or self.simulation.step_s <= 0:
            return 0.0
        return self.replicas * self.replica_batch / self.simulation.step_s

    @property
    def peak_memory_bytes(self) -> int:
        return max(self.simulation.stage_memory_bytes) if self.simulation else 0

    def label(self) -> str:
        if not self.stages:
            return self.precision.value
        recompute = f", recompute {len(self.recomputed)} block(s)" if self.recomputed else ""
        micro = f", M={self.micro_batches}" if self.micro_batches else ""
        return f"{self.stages} stage(s) x {self.replicas} replica(s), {self.precision.value}{recompute}{micro}"

    def describe(self) -> dict[str, Any]:
        described: dict[str, Any] = {
            "stages": self.stages, "replicas": self.replicas, "precision": self.precision.value,
            "recomputed_blocks": list(self.recomputed), "micro_batches": self.micro_batches,
            "replica_batch": self.replica_batch,
        }
        if self.partition is not None:
            described["bounds"] = [list(b) for b in self.partition.bounds]
        if self.simulation is not None:
            described |= {"samples_per_s": self.samples_per_s, "step_s": self.simulation.step_s,
                          "bubble_fraction": self.simulation.bubble_fraction,
                          "sync_exposed_s": self.simulation.sync_exposed_s,
                          "stage_memory_bytes": self.simulation.stage_memory_bytes}
        if self.reason:
            described["rejected"] = self.reason
        return described


@dataclass(frozen=True)
class LeverChoice:
    chosen: Candidate
    rejected: list[Candidate] = field(default_factory=list)


def recompute_set(eligible: Sequence[int], count: int) -> tuple[int, ...]:
    """``count`` of the ``eligible`` blocks, spread evenly, so every stage of a split gets its share."""
    if not 0 <= count <= len(eligible):
        raise ValueError(f"cannot recompute {count} of {len(eligible)} eligible blocks")
    return tuple(eligible[(2 * j + 1) * len(eligible) // (2 * count)] for j in range(count))


def _with_recomputation(costs: Sequence[BlockCost], blocks: Sequence[int]) -> list[BlockCost]:
    chosen = set(blocks)
    return [recomputed(cost, costs[i - 1].output_bytes) if i in chosen else cost for i, cost in enumerate(costs)]


def _eligible_for_recompute(costs: Sequence[BlockCost], states: Sequence[BlockState]) -> list[int]:
    """Trainable blocks whose input is an activation (not the model's input) smaller than what they save."""
    return [i for i in range(1, len(costs))
            if states[i] is BlockState.ACTIVE and costs[i].activation_bytes > costs[i - 1].output_bytes]


def _micro_batch_candidates(stages: int, batch: int, settings: LeverSettings) -> list[int]:
    fixed = settings.micro_batches
    if isinstance(fixed, Mapping) and stages in fixed:
        return [fixed[stages]]
    if isinstance(fixed, int) and stages > 1:
        return [fixed]
    if stages == 1:
        return [1]
    return micro_batch_candidates(stages, batch, settings.max_micro_batch_factor)


def _held(stages: int, batch: int, micro_batches: int, settings: LeverSettings) -> tuple[int, int]:
    """(micro-batch size, micro-batches in flight) the memory check assumes: GPipe holds all M, 1F1B at
    most K (stage 0) before its first backward; the simulation then reads each stage's own peak."""
    size = math.ceil(batch / micro_batches)
    if stages == 1:
        return batch, 1
    return size, micro_batches if settings.schedule == "gpipe" else min(stages, micro_batches)


class _Fitter:
    """The least recomputation with which one (stages, precision, micro-batches) fits, and its partition."""

    def __init__(self, costs: Sequence[BlockCost], states: list[BlockState], cluster: Cluster,
                 settings: LeverSettings) -> None:
        self.costs, self.states, self.cluster, self.settings = costs, states, cluster, settings
        self.eligible = _eligible_for_recompute(costs, states) if settings.recompute else []

    def partition(self, stages: int, size: int, in_flight: int, count: int) -> Partition:
        blocks = recompute_set(self.eligible, count)
        return partition(_with_recomputation(self.costs, blocks), self.states, stages, micro_batch_size=size,
                         memory_budget_bytes=self.settings.memory_budget_bytes, link=self.cluster.intra_node,
                         optimizer_state_factor=self.settings.optimizer_state_factor,
                         in_flight_micro_batches=in_flight)

    def fit(self, stages: int, size: int, in_flight: int) -> tuple[int, Partition]:
        """Smallest recompute count that fits (binary search: memory falls as the count grows)."""
        try:
            return 0, self.partition(stages, size, in_flight, 0)
        except PartitionError as error:
            if not self.eligible:
                raise _NoFit(error) from None
        most = len(self.eligible)
        try:
            best = (most, self.partition(stages, size, in_flight, most))
        except PartitionError as error:
            raise _NoFit(error, recomputing=most) from None
        low, high = 1, most - 1
        while low <= high:
            middle = (low + high) // 2
            try:
                best = (middle, self.partition(stages, size, in_flight, middle))
                high = middle - 1
            except PartitionError:
                low = middle + 1
        return best


class _NoFit(Exception):
    def __init__(self, error: PartitionError, recomputing: int = 0) -> None:
        super().__init__(str(error))
        self.error, self.recomputing = error, recomputing

    def reason(self) -> str:
        saver = f" even recomputing all {self.recomputing} eligible blocks" if self.recomputing else ""
        needed = self.error.needed_bytes
        return f"does not fit{saver}" + ("" if needed is None else f": needs {readable_bytes(needed)} per device")


def simulate_layout(costs: Sequence[BlockCost], cluster: Cluster, settings: LeverSettings, *, frozen_blocks: int,
                    cached_blocks: int, bounds: Sequence[tuple[int, int]], replicas: int, replica_batch: int,
                    micro_batches: int, recomputed: Sequence[int] = ()) -> StepSimulation:
    """One step of a given layout (what a run did, e.g. from its ``layout_history``), not a chosen one."""
    states = block_states(len(costs), frozen_blocks, cached_blocks)
    return _simulate(costs, states, cluster, settings, len(bounds), replicas, replica_batch, micro_batches,
                     tuple(recomputed), bounds)


def _simulate(costs: Sequence[BlockCost], states: list[BlockState], cluster: Cluster, settings: LeverSettings,
              stages: int, replicas: int, batch: int, micro_batches: int, blocks: tuple[int, ...],
              bounds: Sequence[tuple[int, int]]) -> StepSimulation:
    size = math.ceil(batch / micro_batches)
    works = stage_works(_with_recomputation(costs, blocks), states, bounds, micro_batch_size=size,
                        overhead_s=cluster.micro_batch_overhead_s,
                        memory_bytes_per_s=cluster.device.memory_bytes_per_s, bucket_bytes=settings.bucket_bytes,
                        optimizer_state_factor=settings.optimizer_state_factor,
                        touched_rows_samples=batch * replicas if settings.touched_rows_only else None)
    links = [cluster.link_between(s, s + 1) for s in range(stages - 1)]  # replica 0; the others alike
    sync = []
    for s in range(stages):
        ranks = [r * stages + s for r in range(replicas)]
        crosses = cluster.spans_nodes(ranks)
        sync.append(SyncGroup(replicas, cluster.inter_node if crosses else cluster.intra_node,
                              INTER_NODE if crosses else f"stage {s} group"))
    return simulate_step(works, num_micro_batches=micro_batches, schedule=settings.schedule, links=links, sync=sync,
                         overlap=settings.overlap_pipelined_allreduce or stages == 1,
                         cache_link=cluster.host_to_device)


def _candidate(costs: Sequence[BlockCost], states: list[BlockState], cluster: Cluster, settings: LeverSettings,
               stages: int, precision: Precision, batch: int) -> Candidate:
    replicas = cluster.world_size // stages
    if batch < 1:
        return Candidate(stages, replicas, precision, reason="the global batch gives each replica no sample")
    fitter = _Fitter(costs, states, cluster, settings)
    options = []
    failure: _NoFit | None = None
    for micro_batches in _micro_batch_candidates(stages, batch, settings):
        size, in_flight = _held(stages, batch, micro_batches, settings)
        try:
            count, part = fitter.fit(stages, size, in_flight)
        except _NoFit as error:
            failure = failure or error
            continue
        predicted = predict_step_time(part, batch, micro_batches, cluster.micro_batch_overhead_s)
        options.append((predicted, count, micro_batches, part))
    if not options:
        assert failure is not None
        return Candidate(stages, replicas, precision, replica_batch=batch, reason=failure.reason())
    _, count, micro_batches, part = min(options, key=lambda option: option[:3])
    blocks = recompute_set(fitter.eligible, count)
    simulation = _simulate(costs, states, cluster, settings, stages, replicas, batch, micro_batches, blocks,
                           part.bounds)
    candidate = Candidate(stages, replicas, precision, blocks, micro_batches, batch, part, simulation)
    if candidate.peak_memory_bytes > settings.memory_budget_bytes:
        return replace(candidate, reason=f"holds {readable_bytes(candidate.peak_memory_bytes)} on its fullest device "
                                         "in the simulated schedule, over the budget")
    return candidate


def choose_levers(
    costs: Mapping[Precision, Sequence[BlockCost] | None],
    cluster: Cluster,
    *,
    frozen_blocks: int,
    cached_blocks: int,
    replica_batch: Callable[[int], int],
    settings: LeverSettings,
) -> LeverChoice:
    """The fastest fitting layout for this freeze state, and every rejected alternative with its reason.

    ``costs`` gives per-sample block costs in each precision (None: the device lacks it);
    ``replica_batch(replicas)`` each replica's batch for that many replicas (``dp.batch_policy``).
    Ties go to fewer recomputed blocks, then fp32, then fewer stages. Raises :class:`NoLayoutError` (a
    :class:`PartitionError`) when nothing fits.
    """
    known = [precision_costs for precision_costs in costs.values() if precision_costs is not None]
    if not known:
        raise ValueError("choose_levers needs block costs in at least one precision")
    states = block_states(len(known[0]), frozen_blocks, cached_blocks)
    runnable = len(known[0]) - cached_blocks
    counts = settings.stage_counts or tuple(valid_stage_counts(cluster.world_size))
    candidates = []
    for precision in settings.precisions:
        precision_costs = costs.get(precision)
        if precision_costs is None:  # one entry, not one per stage count
            candidates.append(Candidate(0, 0, precision, reason=f"{cluster.device.name} has no {precision.value}"))
            continue
        for stages in counts:
            if cluster.world_size % stages == 0 and stages <= runnable:
                candidates.append(_candidate(precision_costs, states, cluster, settings, stages, precision,
                                             replica_batch(cluster.world_size // stages)))
    fitting = [c for c in candidates if not c.reason]
    if not fitting:
        reasons = "; ".join(f"{c.label()}: {c.reason}" for c in candidates) or "no stage count divides the world"
        remedies = ["raise the memory budget", *([] if settings.recompute else ["allow recomputation"]),
                    *([] if Precision.BF16 in settings.precisions else ["allow bf16"]), "use more devices"]
        raise NoLayoutError(f"nothing fits {readable_bytes(settings.memory_budget_bytes)} per device with "
                            f"{frozen_blocks} frozen blocks: {reasons}; {', '.join(remedies[:-1])} or {remedies[-1]}",
                            reasons)
    chosen = max(fitting, key=lambda c: (c.samples_per_s, -len(c.recomputed), c.precision is Precision.FP32,
                                         -c.stages))
    rejected = []
    for candidate in candidates:
        if candidate is chosen:
            continue
        reason = candidate.reason or (f"slower: {candidate.samples_per_s:.0f} samples/s, "
                                      f"{candidate.samples_per_s / chosen.samples_per_s:.2f}x of the chosen")
        rejected.append(replace(candidate, reason=reason))
    return LeverChoice(chosen, rejected)


def fastest_local_fit(costs: Sequence[BlockCost], world_size: int, settings: LeverSettings, *, memory_gb: float | None,
                      link_bandwidth_gb_s: float, micro_batch_overhead_s: float, frozen_blocks: int,
                      cached_blocks: int, replica_batch: Callable[[int], int]) -> Candidate:
    """The live planner's one question to this predictor (``pipe.recompute``): the fastest fit of stages and
    recomputation for ``world_size`` workers on this machine, a ``local`` cluster whose block ``costs`` (in
    ``settings``' one precision) are given. Raises :class:`NoLayoutError` when nothing fits."""
    cluster = local_cluster(world_size, memory_gb=memory_gb, link_bandwidth_gb_s=link_bandwidth_gb_s,
                            flops_per_second=math.inf,  # never read: the block costs are given
                            micro_batch_overhead_s=micro_batch_overhead_s)
    (precision,) = settings.precisions
    return choose_levers({precision: costs}, cluster, frozen_blocks=frozen_blocks, cached_blocks=cached_blocks,
                         replica_batch=replica_batch, settings=settings).chosen
