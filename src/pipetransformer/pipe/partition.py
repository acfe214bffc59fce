"""AutoPipe's decisions: cut blocks into stages, shrink the pipeline, pick the micro-batch count.

All exact and pure. Cached blocks (a prefix whose output is served from the cache) belong to no
stage: a :class:`Partition` covers blocks ``first_block .. num_blocks-1`` only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipetransformer.pipe.cost import (
    ADAMW_STATE_FACTOR,
    BlockCost,
    BlockState,
    Link,
    StageTiming,
    stage_memory,
    stage_timing,
    validate_states,
)
from pipetransformer.pipe.layout import valid_stage_counts

__all__ = [
    "DEFAULT_MAX_MICRO_BATCH_FACTOR",
    "GIB",
    "MicroBatchPlan",
    "Partition",
    "PartitionError",
    "bubble_fraction",
    "choose_micro_batches",
    "choose_partition_and_micro_batches",
    "compress",
    "micro_batch_candidates",
    "partition",
    "predict_step_time",
]

DEFAULT_MAX_MICRO_BATCH_FACTOR = 8
"""At M = 8K micro-batches the bubble is under 1/9 of a step; beyond, mostly per-message overhead grows."""

GIB, MIB = 1024**3, 1024**2
"""Bytes per GiB and MiB, for error messages people can read."""


def readable_bytes(num_bytes: float) -> str:
    """Bytes in GiB, or in MiB below one GiB, so small budgets do not print as 0.00."""
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB else f"{num_bytes / MIB:.1f} MiB"


def counted(count: int, noun: str) -> str:
    """``1 stage``, ``2 stages``: error messages name counts a user typed."""
    return f"{count} {noun}" + ("" if count == 1 else "s")


class PartitionError(ValueError):
    """No partition satisfies the request; the message says what to change.

    ``needed_bytes``: when memory was the obstacle, the smallest per-device memory any split needs.
    """

    def __init__(self, message: str, needed_bytes: float | None = None) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes


@dataclass(frozen=True)
class Partition:
    """Contiguous stages over blocks ``first_block .. num_blocks-1``; blocks before are cached.

    ``stage_times`` and ``stage_memories`` are for ``micro_batch_size``; ``stage_timings`` lets the
    times be re-evaluated for another micro-batch size (see :func:`predict_step_time`).
    """

    bounds: list[tuple[int, int]]
    stage_times: list[float]
    stage_memories: list[int]
    stage_timings: list[StageTiming]
    micro_batch_size: int
    num_blocks: int

    @property
    def num_stages(self) -> int:
        return len(self.bounds)

    @property
    def first_block(self) -> int:
        """Index of the first block any stage runs; blocks below it are served from the cache."""
        return self.bounds[0][0]

    @property
    def bottleneck(self) -> float:
        """Seconds the slowest stage needs per micro-batch: the pipeline's beat."""
        return max(self.stage_times)

    def stage_of(self, block: int) -> int | None:
        """The stage running ``block``, or None for a cached block."""
        for stage, (start, end) in enumerate(self.bounds):
            if start <= block < end:
                return stage
        if 0 <= block < self.first_block:
            return None
        raise IndexError(f"block {block} is outside 0..{self.num_blocks - 1}")


def _cached_prefix(states: Sequence[BlockState]) -> int:
    return sum(1 for state in states if state is BlockState.CACHED)


def _min_max_split(
    first: int, last: int, num_stages: int, cost: Callable[[int, int], float]
) -> tuple[float, list[int]]:
    """Exact min over contiguous splits of ``first..last-1`` into non-empty stages of the max stage cost.

    Dynamic programming over (stages used, prefix end); infinite cost marks a forbidden stage.
    Returns the optimum and the stage start points (ties go to the earliest cut, so it is deterministic).
    """
    best = {(0, first): 0.0}
    choice: dict[tuple[int, int], int] = {}
    for used in range(1, num_stages + 1):
        for end in range(first + used, last - (num_stages - used) + 1):
            value, arg = math.inf, -1
            for start in range(first + used - 1, end):
                previous = best.get((used - 1, start), math.inf)
                candidate = max(previous, cost(start, end))
                if candidate < value:
                    value, arg = candidate, start
            best[(used, end)] = value
            choice[(used, end)] = arg
    optimum = best[(num_stages, last)]
    if math.isinf(optimum):
        return optimum, []
    starts, end = [], last
    for used in range(num_stages, 0, -1):
        end = choice[(used, end)]
        starts.append(end)
    return optimum, starts[::-1]


def partition(costs: Sequence[BlockCost], states: Sequence[BlockState], num_stages: int, *, micro_batch_size: int,
              memory_budget_bytes: float, link: Link, optimizer_state_factor: int = ADAMW_STATE_FACTOR,
              in_flight_micro_batches: int = 1) -> Partition:
    """The contiguous split of the uncached blocks into ``num_stages`` stages with the fastest slowest
    stage (compute plus its boundary messages), every stage within ``memory_budget_bytes``
    (``math.inf``: unlimited).
    """
    validate_states(costs, states)
    if num_stages < 1 or micro_batch_size < 1:
        raise PartitionError(f"num_stages and micro_batch_size must be >= 1, got {num_stages} and {micro_batch_size}")
    first, last = _cached_prefix(states), len(costs)
    if first == last:
        raise PartitionError(
            f"all {last} blocks are cached, so no stage has anything to run: keep at least the head active"
        )
    if num_stages > last - first:
        raise PartitionError(
            f"cannot split the {last - first} uncached blocks ({first}..{last - 1}) into {num_stages} stages: "
            f"use at most {last - first} stages"
        )

    def memory(start: int, end: int) -> int:
        return stage_memory(
            costs,
            states,
            start,
            end,
            micro_batch_size=micro_batch_size,
            optimizer_state_factor=optimizer_state_factor,
            in_flight_micro_batches=in_flight_micro_batches,
        )

    memories = {(s, e): memory(s, e) for s in range(first, last) for e in range(s + 1, last + 1)}
    timings = {key: stage_timing(costs, states, *key, link) for key in memories}

    def time_within_budget(start: int, end: int) -> float:
        if memories[(start, end)] > memory_budget_bytes:
            return math.inf
        return timings[(start, end)].at(micro_batch_size)

    bottleneck, starts = _min_max_split(first, last, num_stages, time_within_budget)
    if math.isinf(bottleneck):
        needed, _ = _min_max_split(first, last, num_stages, lambda s, e: float(memories[(s, e)]))
        raise PartitionError(
            f"no split of blocks {first}..{last - 1} into {counted(num_stages, 'stage')} fits "
            f"{int(memory_budget_bytes)} bytes ({readable_bytes(memory_budget_bytes)}); "
            f"it needs at least {int(needed)} bytes ({readable_bytes(needed)}): raise the budget, "
            f"use more stages, a smaller micro-batch, or freeze/cache more blocks",
            needed_bytes=needed,
        )
    bounds = list(zip(starts, [*starts[1:], last], strict=True))
    return Partition(
        bounds=bounds,
        stage_times=[timings[b].at(micro_batch_size) for b in bounds],
        stage_memories=[memories[b] for b in bounds],
        stage_timings=[timings[b] for b in bounds],
        micro_batch_size=micro_batch_size,
        num_blocks=last,
    )


def compress(
    costs: Sequence[BlockCost],
    states: Sequence[BlockState],
    world_size: int,
    *,
    micro_batch_size: int | Callable[[int], int],
    memory_budget_bytes: float,
    link: Link,
    optimizer_state_factor: int = ADAMW_STATE_FACTOR,
    in_flight_micro_batches: int | Callable[[int], int] = 1,
) -> Partition:
    """The partition with the fewest stages that divides ``world_size`` and fits the budget.

    Fewer stages leave more ranks for data-parallel replicas, which on a pipeline's bubble and
    messages is the cheaper way to use them; one stage means pure data parallelism. For a given
    stage count the partition is already the fastest, so ties between plans cannot remain.
    ``micro_batch_size`` may depend on the stage count (a function of it): with more replicas each
    one's batch, and so its activation memory, shrinks; so may ``in_flight_micro_batches`` (1F1B).
    """
    validate_states(costs, states)
    counts = [k for k in valid_stage_counts(world_size) if k <= max(1, len(costs) - _cached_prefix(states))]

    def plan(num_stages: int) -> Partition:
        return partition(
            costs,
            states,
            num_stages,
            micro_batch_size=micro_batch_size(num_stages) if callable(micro_batch_size) else micro_batch_size,
            memory_budget_bytes=memory_budget_bytes,
            link=link,
            optimizer_state_factor=optimizer_state_factor,
            in_flight_micro_batches=in_flight_micro_batches(num_stages) if callable(in_flight_micro_batches)
            else in_flight_micro_batches,
        )

    for num_stages in counts[:-1]:
        try:
            return plan(num_stages)
        except PartitionError:
            continue
    try:
        return plan(counts[-1])
    except PartitionError as error:
        raise PartitionError(
            f"no stage count dividing world_size={world_size} ({', '.join(map(str, counts))}) fits; "
            f"with {counted(counts[-1], 'stage')}: {error}"
        ) from error


@dataclass(frozen=True)
class MicroBatchPlan:
    """The chosen micro-batch count and what the cost model predicts for it."""

    num_micro_batches: int
    micro_batch_size: int
    predicted_step_s: float
    bubble_fraction: float


def bubble_fraction(num_stages: int, num_micro_batches: int) -> float:
    """Share of a GPipe step each stage idles: (K - 1) / (M + K - 1)."""
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def predict_step_time(
    partition: Partition, batch_size: int, num_micro_batches: int, per_microbatch_overhead_s: float
) -> float:
    """One micro-batch through every stage (fill and drain), then M - 1 beats of the slowest stage.

    Each stage time includes a fixed per-micro-batch overhead. With equal stages this is the familiar
    (M + K - 1) beats; with unequal ones the fill and drain run at each stage's own pace, which the
    pipeline benchmark measured (uniform vs balanced split: 1.10x measured, 1.13x by this formula,
    1.22x by the bottleneck alone).
    """
    largest = math.ceil(batch_size / num_micro_batches)
    stage_s = [timing.at(largest) + per_microbatch_overhead_s for timing in partition.stage_timings]
    return sum(stage_s) + (num_micro_batches - 1) * max(stage_s)


def micro_batch_candidates(num_stages: int, batch_size: int,
                           max_factor: int = DEFAULT_MAX_MICRO_BATCH_FACTOR) -> list[int]:
    """The micro-batch counts worth weighing, in increasing order.

    Only divisors of ``batch_size``, because a pipeline stage sizes its receive buffers from the first
    micro-batch. Candidates lie in ``K .. max_factor * K``; if no divisor does, any divisor up to
    ``max_factor * K`` (so at least M = 1).
    """
    if batch_size < 1 or max_factor < 1:
        raise ValueError(f"batch_size and max_factor must be >= 1, got {batch_size} and {max_factor}")
    divisors = [m for m in range(1, min(batch_size, max_factor * num_stages) + 1) if batch_size % m == 0]
    return [m for m in divisors if m >= num_stages] or divisors


def _micro_batch_plan(partition: Partition, batch_size: int, micro_batches: int,
                      per_microbatch_overhead_s: float) -> MicroBatchPlan:
    return MicroBatchPlan(
        num_micro_batches=micro_batches,
        micro_batch_size=batch_size // micro_batches,
        predicted_step_s=predict_step_time(partition, batch_size, micro_batches, per_microbatch_overhead_s),
        bubble_fraction=bubble_fraction(partition.num_stages, micro_batches),
    )


def choose_micro_batches(
    partition: Partition,
    batch_size: int,
    *,
    per_microbatch_overhead_s: float,
    max_factor: int = DEFAULT_MAX_MICRO_BATCH_FACTOR,
) -> MicroBatchPlan:
    """The micro-batch count M (of :func:`micro_batch_candidates`) with the lowest predicted step time for a
    given partition; ties go to the smaller M. Memory was checked when partitioning: right for GPipe, whose
    stages hold every micro-batch until backward (the whole batch, whatever M is); for 1F1B see
    :func:`choose_partition_and_micro_batches`.
    """
    candidates = micro_batch_candidates(partition.num_stages, batch_size, max_factor)
    best = min(candidates, key=lambda m: (predict_step_time(partition, batch_size, m, per_microbatch_overhead_s), m))
    return _micro_batch_plan(partition, batch_size, best, per_microbatch_overhead_s)


def choose_partition_and_micro_batches(
    costs: Sequence[BlockCost], states: Sequence[BlockState], num_stages: int, batch_size: int, *,
    memory_budget_bytes: float, link: Link, per_microbatch_overhead_s: float,
    optimizer_state_factor: int = ADAMW_STATE_FACTOR, max_factor: int = DEFAULT_MAX_MICRO_BATCH_FACTOR,
) -> tuple[Partition, MicroBatchPlan]:
    """1F1B: the partition and micro-batch count M with the lowest predicted step time, chosen together.

    Stage 0 holds K micro-batches of ``batch_size / M`` samples before its first backward, so the memory a
    split must fit shrinks as M grows, and a better-balanced split may fit only at a larger M; M also sets
    the bubble and the per-micro-batch overhead. Every candidate M (at least K, which torch's 1F1B needs) is
    partitioned against the budget on its own, and the fastest fit wins (ties go to the smaller M). Raises
    the largest M's :class:`PartitionError` (the one needing the least memory) when none fits.
    """
    options: list[tuple[float, int, Partition]] = []
    error: PartitionError | None = None
    for micro_batches in sorted({max(m, num_stages) for m in micro_batch_candidates(num_stages, batch_size,
                                                                                     max_factor)}):
        try:
            part = partition(costs, states, num_stages, micro_batch_size=-(-batch_size // micro_batches),
                             memory_budget_bytes=memory_budget_bytes, link=link,
                             optimizer_state_factor=optimizer_state_factor, in_flight_micro_batches=num_stages)
        except PartitionError as failed:
            error = failed
            continue
        options.append((predict_step_time(part, batch_size, micro_batches, per_microbatch_overhead_s),
                        micro_batches, part))
    if not options:
        assert error is not None
        raise error
    _, micro_batches, part = min(options, key=lambda option: option[:2])
    return part, _micro_batch_plan(part, batch_size, micro_batches, per_microbatch_overhead_s)
