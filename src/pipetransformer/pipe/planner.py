"""From the pipeline settings, block costs and the freeze state to a layout: stages, replicas, partition,
micro-batches.

Pure, so ``pipetransformer plan`` and every training rank compute the same plan without talking.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipetransformer.config import BYTES_PER_GB, DPConfig, PipeConfig
from pipetransformer.dp.batch import replica_batch, replica_count
from pipetransformer.pipe.cost import BlockCost, Link, Precision, block_states
from pipetransformer.pipe.layout import Layout, check_stage_count
from pipetransformer.pipe.partition import (Partition, PartitionError, choose_micro_batches,
                                            choose_partition_and_micro_batches, compress, counted,
                                            micro_batch_candidates, partition)
from pipetransformer.plan.levers import LeverSettings, NoLayoutError, fastest_local_fit

__all__ = ["LayoutPlan", "PlanRequest", "plan_layout", "plan_request", "block_states", "step_micro_batches",
           "PER_MICROBATCH_OVERHEAD_S"]

PER_MICROBATCH_OVERHEAD_S = 1e-3
"""Cost of one micro-batch per stage beyond its blocks' own costs per call (schedule bookkeeping, p2p latency), a
CPU/gloo estimate. Fitted on the step-time ratios between 4, 8 and 16 micro-batches of both shipped pipelines
(benchmarks/planner/README.md, "The micro-batch count"): 1 ms fits them best once blocks are profiled per call
(0.5-2 ms within 1.5x of its error). Before that it was 20 ms, standing in for those costs per call."""

GPIPE = "gpipe"
ONE_F_ONE_B = "1f1b"


@dataclass(frozen=True)
class LayoutPlan:
    layout: Layout  # active ranks: num_stages x dp_width; ranks past layout.world_size idle
    partition: Partition
    micro_batches: int
    cached_blocks: int  # leading blocks served from the cache (not run by any stage)
    frozen_blocks: int  # leading frozen blocks (cached or run without autograd on stage 0)
    recomputed_blocks: tuple[int, ...] = ()  # active blocks that keep only their input for backward

    def held_bounds(self) -> list[tuple[int, int]]:
        """Blocks each stage's ranks hold: stage 0 also holds the prefix it serves or computes."""
        bounds = list(self.partition.bounds)
        bounds[0] = (0, bounds[0][1])
        return bounds

    def describe(self) -> dict[str, Any]:
        return {
            "stages": self.layout.num_stages,
            "dp_width": self.layout.dp_width,
            "micro_batches": self.micro_batches,
            "bounds": [list(b) for b in self.partition.bounds],
            "cached_blocks": self.cached_blocks,
            "frozen_blocks": self.frozen_blocks,
            "recomputed_blocks": list(self.recomputed_blocks),
        }


def _fixed_stages(pipe: PipeConfig, world_size: int) -> int:
    """``pipe.stages`` when it is a number, checked against the world."""
    stages = int(pipe.stages)
    check_stage_count(stages, world_size)
    return stages


@dataclass(frozen=True)
class PlanRequest:
    """What AutoPipe plans a layout from, besides block costs and the freeze state: a config's settings, read once
    by :func:`plan_request` for the trainer and the ``plan`` command alike."""

    pipe: PipeConfig
    elastic: bool  # dp.enabled: the workers a compression frees become replicas
    batch_size: int  # train.batch_size: the global batch at the starting width
    precision: Precision  # train.precision: what the block costs are in
    touched_rows_only: bool  # dp.touched_rows_only: how replicas sum vocabulary tables

    def plan(self, costs: list[BlockCost], world_size: int, *, frozen_blocks: int, cached_blocks: int,
             dp_width: int | None = None, global_batch: Callable[[int], int] | None = None) -> LayoutPlan:
        """:func:`plan_layout` of these settings for a freeze state (``dp_width``, ``global_batch``: the run's)."""
        return plan_layout(self.pipe, costs, world_size, elastic=self.elastic, batch_size=self.batch_size,
                           frozen_blocks=frozen_blocks, cached_blocks=cached_blocks, dp_width=dp_width,
                           global_batch=global_batch, precision=self.precision,
                           touched_rows_only=self.touched_rows_only)


def plan_request(pipe: PipeConfig, dp: DPConfig, batch_size: int, precision: Precision) -> PlanRequest:
    """The planner's request from a config's sections (``train.batch_size``, ``train.precision``)."""
    return PlanRequest(pipe, elastic=dp.enabled, batch_size=batch_size, precision=precision,
                       touched_rows_only=dp.touched_rows_only)


def plan_layout(pipe: PipeConfig, costs: list[BlockCost], world_size: int, *, elastic: bool, batch_size: int,
                frozen_blocks: int, cached_blocks: int, dp_width: int | None = None,
                global_batch: Callable[[int], int] | None = None, precision: Precision = Precision.FP32,
                touched_rows_only: bool = True) -> LayoutPlan:
    """The layout for the current freeze state.

    ``pipe.stages: auto`` compresses to the fewest stages that fit ``pipe.device_memory_gb``. With ``elastic``
    (``dp.enabled``) the freed ranks become replicas (width = world / stages); without it the width stays
    ``dp_width`` (the initial one) and freed ranks idle, which is what AutoPipe alone would do.
    ``global_batch`` gives the global batch for a width (``dp.batch_policy``); default: ``batch_size``.
    With ``pipe.recompute`` the offline predictor (:func:`pipetransformer.plan.levers.fastest_local_fit`) weighs
    stages against recomputation instead, by the predicted samples/s of the whole world; ``costs`` are then in
    ``precision``, and
    ``touched_rows_only`` (``dp.touched_rows_only``) says how replicas sum vocabulary tables.
    """
    if pipe.recompute:
        return _plan_with_levers(pipe, costs, world_size, batch_size=batch_size, frozen_blocks=frozen_blocks,
                                 cached_blocks=cached_blocks, global_batch=global_batch, precision=precision,
                                 touched_rows_only=touched_rows_only)
    states = block_states(len(costs), frozen_blocks, cached_blocks)
    link = Link(pipe.link_bandwidth_gbps * BYTES_PER_GB)
    budget = pipe.memory_budget_bytes()
    runnable = len(costs) - cached_blocks

    def width_for(stages: int) -> int:
        return replica_count(world_size, stages, elastic=elastic or not pipe.enabled, initial_width=dp_width)

    def batch_of_a_replica(stages: int) -> int:
        return replica_batch(width_for(stages), batch_size, global_batch)

    def held_activations(stages: int) -> tuple[int, int]:
        """(micro-batch size, micro-batches in flight) a stage holds activations for before their backward.

        The replica's whole batch without a pipeline and with GPipe; with 1F1B, stage 0 holds
        min(stages, M) micro-batches, which is what lets a pipeline fit where data parallelism's whole
        batches do not. An "auto" count is taken at its largest candidate here, the one needing the least
        memory, so a stage count fits when any count does; the count itself is chosen below.
        """
        batch = batch_of_a_replica(stages)
        if stages == 1 or pipe.schedule != ONE_F_ONE_B:
            return batch, 1
        if pipe.micro_batches == "auto":
            micro_batches = max(micro_batch_candidates(stages, batch))
        else:
            micro_batches = int(pipe.micro_batches)
        return -(-batch // max(micro_batches, stages)), stages

    def attempt(stages: int) -> Partition:
        size, in_flight = held_activations(stages)
        return partition(costs, states, stages, micro_batch_size=size, memory_budget_bytes=budget, link=link,
                         in_flight_micro_batches=in_flight)

    if not pipe.enabled:
        stages, part = 1, attempt(1)
    elif pipe.stages == "auto":
        ranks = world_size if (elastic or dp_width is None) else world_size // dp_width
        try:
            part = compress(costs, states, ranks, micro_batch_size=lambda k: held_activations(k)[0],
                            memory_budget_bytes=budget, link=link,
                            in_flight_micro_batches=lambda k: held_activations(k)[1])
        except PartitionError as error:
            raise PartitionError(f"pipe.device_memory_gb={pipe.device_memory_gb} is too small for "
                                 f"{counted(ranks, 'worker')}: {error}") from None
        stages = part.num_stages
    else:
        stages = _fixed_stages(pipe, world_size)
        if stages > runnable:
            raise PartitionError(f"pipe.stages={stages} but the model has only {runnable} blocks to run: "
                                 "use fewer stages")
        part = attempt(stages)
    width = width_for(stages)
    micro = 1
    if stages > 1:
        if pipe.micro_batches == "auto" and pipe.schedule == ONE_F_ONE_B:
            part, chosen = choose_partition_and_micro_batches(
                costs, states, stages, batch_of_a_replica(stages), memory_budget_bytes=budget, link=link,
                per_microbatch_overhead_s=PER_MICROBATCH_OVERHEAD_S)
            micro = chosen.num_micro_batches
        elif pipe.micro_batches == "auto":
            micro = choose_micro_batches(part, batch_of_a_replica(stages),
                                         per_microbatch_overhead_s=PER_MICROBATCH_OVERHEAD_S).num_micro_batches
        else:
            micro = int(pipe.micro_batches)
        if pipe.schedule == ONE_F_ONE_B:
            micro = max(micro, stages)
    return LayoutPlan(Layout(stages, width), part, micro, cached_blocks, frozen_blocks)


def _plan_with_levers(pipe: PipeConfig, costs: list[BlockCost], world_size: int, *, batch_size: int,
                      frozen_blocks: int, cached_blocks: int, global_batch: Callable[[int], int] | None,
                      precision: Precision, touched_rows_only: bool) -> LayoutPlan:
    """``pipe.recompute``: the fastest fit of stages and recomputation on this machine as a ``local`` cluster (the
    config checks that AutoPipe is on and that the replicas are world / stages: AutoDP on, or the stages fixed)."""
    stage_counts = None if pipe.stages == "auto" else (_fixed_stages(pipe, world_size),)
    settings = LeverSettings(memory_budget_bytes=pipe.memory_budget_bytes(), schedule=pipe.schedule,
                             micro_batches=pipe.micro_batches if isinstance(pipe.micro_batches, int) else None,
                             precisions=(precision,), recompute=True, stage_counts=stage_counts,
                             touched_rows_only=touched_rows_only)
    try:
        chosen = fastest_local_fit(costs, world_size, settings, memory_gb=pipe.device_memory_gb,
                                   link_bandwidth_gb_s=pipe.link_bandwidth_gbps,
                                   micro_batch_overhead_s=PER_MICROBATCH_OVERHEAD_S, frozen_blocks=frozen_blocks,
                                   cached_blocks=cached_blocks,
                                   replica_batch=lambda replicas: replica_batch(replicas, batch_size, global_batch))
    except NoLayoutError as error:
        raise PartitionError(f"pipe.device_memory_gb={pipe.device_memory_gb} is too small for "
                             f"{counted(world_size, 'worker')}: {error}") from None
    assert chosen.partition is not None
    return LayoutPlan(Layout(chosen.stages, chosen.replicas), chosen.partition, max(1, chosen.micro_batches),
                      cached_blocks, frozen_blocks, chosen.recomputed)


def step_micro_batches(rows: int, planned: int, stages: int, schedule: str) -> tuple[int, str]:
    """The micro-batch count and schedule for one step of ``rows`` samples on a ``stages``-stage pipeline.

    Micro-batches must be equal in size (a stage's buffers have one shape), so the count divides ``rows``:
    the largest divisor up to ``planned``. 1F1B also needs at least one micro-batch per stage (torch refuses
    fewer); for a batch with no such divisor up to ``planned`` (an epoch's tail, a prime share) it takes the
    smallest one above, whose micro-batches are smaller than planned, so the memory plan still holds; with
    fewer samples than stages that step runs GPipe, holding ``rows`` < ``stages`` samples.
    """
    divisors = [d for d in range(1, rows + 1) if rows % d == 0]
    if schedule != ONE_F_ONE_B:
        return max(d for d in divisors if d <= planned), schedule
    valid = [d for d in divisors if d >= stages]
    if not valid:
        return max(d for d in divisors if d <= planned), GPIPE
    return max((d for d in valid if d <= planned), default=min(valid)), schedule

