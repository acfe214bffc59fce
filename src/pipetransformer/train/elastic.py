"""AutoPipe and AutoDP in a run: the layout, which blocks this rank holds, its groups, and how that changes.

AutoPipe plans a layout for the current freeze state (``pipe.planner``: the active blocks over the fewest
stages that fit, micro-batches) from block costs measured once. AutoDP turns the workers a compression
frees into replicas: at a transition every block's weights and optimizer state move point to point to
their new owners (``dp.handover``), the process groups are rebuilt, and the step executor for this rank's
new place is built (``train.step``). ``rank = replica * stages + stage``; ranks past the layout idle.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pipetransformer.config import BYTES_PER_MIB, DPConfig, PipeConfig
from pipetransformer.data.sampler import ElasticSampler
from pipetransformer.distributed import DistEnv, gather_floats, new_groups
from pipetransformer.dp.batch import global_batch, lr_scale
from pipetransformer.dp.handover import BlockTransfer, broadcast_blocks, hand_over, transfer_blocks
from pipetransformer.dp.sync import GradientSync, row_summed_tables
from pipetransformer.dp.ties import TiedWeightSync
from pipetransformer.pipe.cost import BlockCost, Precision
from pipetransformer.pipe.planner import LayoutPlan, plan_request
from pipetransformer.pipe.profile import PROFILE_BATCH, broadcast_costs, estimate_block_costs
from pipetransformer.train.build import example_inputs
from pipetransformer.train.optimizer import HeldOptimizer, OptimizerState
from pipetransformer.train.step import LocalStep, PipelineStep, StepContext, StepExecutor

if TYPE_CHECKING:  # both import this module
    from pipetransformer.train.autofreeze import AutoFreeze
    from pipetransformer.train.state import Progress

logger = logging.getLogger(__name__)

__all__ = ["ElasticLayout", "Placement", "UNIFORM_COST"]

UNIFORM_COST = BlockCost(forward_s=1.0, backward_s=2.0, output_bytes=0, param_bytes=0, activation_bytes=0)
"""Every block's cost without AutoPipe: one stage holds them all, so only their count matters."""


@dataclass(frozen=True)
class Placement:
    """Where this rank is under a plan."""

    plan: LayoutPlan
    replica: int | None  # None: an idle rank (past the layout's ranks)
    stage: int | None
    blocks: tuple[int, int]  # [start, end) of the blocks it holds (stage 0 includes the frozen prefix)

    @classmethod
    def of(cls, plan: LayoutPlan, rank: int) -> Placement:
        if rank >= plan.layout.world_size:
            return cls(plan, None, None, (0, 0))
        replica, stage = plan.layout.coords(rank)
        return cls(plan, replica, stage, plan.held_bounds()[stage])

    @property
    def last_stage(self) -> bool:
        return self.stage is not None and self.stage == self.plan.layout.num_stages - 1

    def share(self, global_batch: list[int]) -> list[int]:
        """This replica's contiguous share of a global batch."""
        assert self.replica is not None
        return ElasticSampler.split_for_replica(global_batch, self.plan.layout.dp_width, self.replica)


class ElasticLayout:
    """The current plan and this rank's place in it; ``transition`` moves the run to another plan."""

    def __init__(self, context: StepContext, env: DistEnv, *, pipe: PipeConfig, dp: DPConfig, batch_size: int,
                 precision: Precision = Precision.FP32) -> None:
        self.context = context
        self.model = context.model
        self.env = env
        self.pipe = pipe
        self.dp = dp
        self.batch_size = batch_size  # train.batch_size: the global batch at the starting width
        self.request = plan_request(pipe, dp, batch_size, precision)  # train.precision: what costs are measured in
        self.initial_width: int | None = None  # set by the first layout (or a resume on as many workers)
        self._placement: Placement | None = None
        self.executor: StepExecutor | None = None  # None on idle ranks
        self.ties: TiedWeightSync | None = None  # None on idle ranks
        self.pipe_group: dist.ProcessGroup | None = None
        self.dp_group: dist.ProcessGroup | None = None
        self._costs: list[BlockCost] | None = None

    @property
    def placement(self) -> Placement:
        assert self._placement is not None, "no layout yet: call transition first"
        return self._placement

    @property
    def plan(self) -> LayoutPlan:
        return self.placement.plan

    def costs(self) -> list[BlockCost]:
        """Per-block costs, measured (or estimated) on rank 0 when first needed and broadcast, so every rank plans
        from the same numbers."""
        if self._costs is None:
            self._costs = self._block_costs()
        return self._costs

    def plan_for(self, frozen_blocks: int, cached_blocks: int) -> LayoutPlan:
        """AutoPipe's layout for this freeze state; with AutoDP its width is what the stages leave."""
        return self.request.plan(self.costs(), self.env.world_size, frozen_blocks=frozen_blocks,
                                 cached_blocks=cached_blocks, dp_width=self.initial_width,
                                 global_batch=self.global_batch)

    def follow(self, freezer: AutoFreeze, optimizer: HeldOptimizer, progress: Progress) -> None:
        """Plan the layout for the freezer's frozen prefix (served by the cache as far as it can), move the run to it
        (:meth:`transition`), and record it in ``progress``: the layout history, and a transition's cost."""
        frozen_layers = freezer.prefix_layers()
        plan = self.plan_for(freezer.prefix_blocks(), self.context.prefix.cached_blocks(frozen_layers))
        transition = self.transition(plan, optimizer)
        step, described = progress.step, plan.describe()
        before = progress.layout_history[-1] if progress.layout_history else None
        progress.layout_history.append({"step": step, "frozen_layers": len(freezer.frozen),
                                        "frozen_prefix_layers": freezer.prefix_layers(), **described})
        if transition is not None:
            progress.transitions.append({"step": step, **transition, **described})
        if self.env.is_main:
            logger.info("%s", _layout_line(step, len(freezer.frozen), described, before, transition))

    def global_batch(self, width: int | None = None) -> int:
        """The global batch at ``width`` replicas (default: the current width) under ``dp.batch_policy``
        (:func:`pipetransformer.dp.batch.global_batch`)."""
        if width is None:
            width = self.plan.layout.dp_width
        return global_batch(self.batch_size, width, self.initial_width, self.dp.batch_policy)

    def lr_scale(self) -> float:
        """Linear scaling rule when the global batch grows with the width (keep_per_pipeline)."""
        return lr_scale(self.batch_size, self.plan.layout.dp_width, self.initial_width, self.dp.batch_policy)

    def transition(self, plan: LayoutPlan, optimizer: HeldOptimizer) -> dict[str, Any] | None:
        """Make ``plan`` the layout (every rank must call): hand blocks over to their new owners, rebuild the
        groups, the optimizer and the step executor, open the cache if the plan caches blocks. Returns the
        seconds it took and the blocks moved, or None for the run's first layout."""
        started = time.perf_counter()
        rank = self.env.rank
        previous, placement = self._placement, Placement.of(plan, rank)
        received: OptimizerState = {}
        moved = 0
        if previous is not None and self.env.distributed:
            received, moved = hand_over(self.model, previous.plan, plan, optimizer.optimizer, rank)
        self._destroy_groups()
        if self.env.distributed:
            self.pipe_group = new_groups(plan.layout.all_pipeline_groups(), rank)
            self.dp_group = new_groups(plan.layout.all_dp_groups(), rank)
        optimizer.rebuild(placement.blocks, received)
        if self.executor is not None:
            self.executor.close()
        self.ties = None if placement.stage is None else TiedWeightSync(
            self.model, rank, plan.layout.rank(placement.replica, 0),
            plan.layout.rank(placement.replica, plan.layout.num_stages - 1))
        self.executor = self._executor(placement, optimizer.params)
        self.context.prefix.open(plan.cached_blocks)
        self._placement = placement
        if self.initial_width is None:
            self.initial_width = plan.layout.dp_width
        if previous is None:
            return None
        return {"seconds": time.perf_counter() - started, "blocks_moved": moved}

    def _executor(self, placement: Placement, params: list[torch.nn.Parameter]) -> StepExecutor | None:
        if placement.stage is None:
            return None
        stages = placement.plan.layout.num_stages
        tied = self.ties is not None and self.ties.live
        # A tied table's gradient holds the output projection's, dense: summing it by touched rows would gather all.
        owners = {id(owner) for owner, _ in self.model.tied_parameters()}
        row_summed = ([p for p in row_summed_tables(self.model.modules(), params) if id(p) not in owners]
                      if self.dp.touched_rows_only else [])
        # One backward per step only without a pipeline schedule: then buckets overlap backward, unless a tied
        # weight's mirror must add its gradient to the owner's first.
        overlap = stages == 1 and not tied
        sync = GradientSync(params, self.dp_group, bucket_bytes=int(self.dp.bucket_mib * BYTES_PER_MIB),
                            overlap=overlap, row_summed=row_summed)
        if stages == 1:
            return LocalStep(self.context, placement.plan, sync)
        assert self.pipe_group is not None
        return PipelineStep(self.context, placement.plan, placement.stage, sync, self.pipe_group, self.pipe.schedule)

    def fold_tied_gradients(self) -> None:
        """Add tied weights' mirror gradients to their owners' (after backward, before the replicas sum them)."""
        if self.ties is not None:
            self.ties.fold_gradients()

    def refresh_tied_weights(self) -> None:
        """Copy the tied weights' updated values into their mirrors (after the optimizer step)."""
        if self.ties is not None:
            self.ties.refresh_mirrors()

    def owners(self) -> dict[int, int]:
        """Block -> the rank of replica 0 that holds it: where the current state of every block is."""
        plan = self.plan
        return {block: plan.layout.rank(0, stage) for stage, (start, end) in enumerate(plan.held_bounds())
                for block in range(start, end)}

    def gather_to_main(self, optimizer: HeldOptimizer) -> OptimizerState:
        """Bring every block to rank 0 (its weights in place there) with its optimizer state, which is returned
        (for a checkpoint; every rank must call)."""
        if not self.env.distributed:
            return {}
        transfers = [BlockTransfer(b, owner, 0) for b, owner in sorted(self.owners().items()) if owner != 0]
        return transfer_blocks(self.model, transfers, optimizer.optimizer, self.env.rank)

    def share_model(self) -> None:
        """Give every rank the current weights of every block (before an evaluation; every rank must call)."""
        layout = self.plan.layout
        if self.env.distributed and (layout.num_stages > 1 or layout.world_size < self.env.world_size):
            broadcast_blocks(self.model, self.owners(), range(len(self.model)))

    def fingerprints(self) -> list[list[float]]:
        """Per rank: [stage, sum of its held parameters in float64]. Replicas of a stage must agree bit for bit."""
        start, end = self.placement.blocks
        total = sum(float(p.detach().double().sum()) for i in range(start, end)
                    for p in self.model.blocks[i].parameters())
        stage = self.placement.stage
        return gather_floats([-1.0 if stage is None else float(stage), total])

    def state_dict(self) -> dict[str, Any]:
        return {"initial_width": self.initial_width, "world_size": self.env.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resume on as many workers keeps the width the run started with; on others it starts afresh."""
        if state["world_size"] == self.env.world_size:
            self.initial_width = state["initial_width"]

    def close(self) -> None:
        """Remove the step's autograd hooks (they and the parameters hold each other out of the garbage
        collector's sight, and with them the data-parallel group), then destroy the groups."""
        if self.executor is not None:
            self.executor.close()
            self.executor = None
        self._destroy_groups()

    def _destroy_groups(self) -> None:
        for group in (self.pipe_group, self.dp_group):
            if group is not None:
                dist.destroy_process_group(group)
        self.pipe_group = self.dp_group = None

    def _block_costs(self) -> list[BlockCost]:
        if not self.pipe.enabled:
            return [UNIFORM_COST for _ in range(len(self.model))]
        ctx = self.context
        costs: list[BlockCost] | None = None
        if self.env.is_main:
            inputs = example_inputs(ctx.dataset, ctx.max_length, ctx.device, PROFILE_BATCH)
            costs = estimate_block_costs(self.model, inputs, num_classes=ctx.task.outputs(ctx.dataset),
                                         measure=self.pipe.profile)
        if self.env.distributed:
            costs = broadcast_costs(costs, len(self.model))
        assert costs is not None, "rank 0 profiles the blocks"
        return costs


def _shape(layout: dict[str, Any]) -> str:
    stages, width = layout["stages"], layout["dp_width"]
    return f"{stages} stage{'s' if stages > 1 else ''} x {width} replica{'s' if width > 1 else ''}"


def _layout_line(step: int, frozen: int, layout: dict[str, Any], before: dict[str, Any] | None,
                 transition: dict[str, Any] | None) -> str:
    """The log's line for a layout: the first one, or a move to a new one after a freeze (what compressed)."""
    now = f"{_shape(layout)}, {layout['micro_batches']} micro-batch(es), {layout['cached_blocks']} block(s) cached"
    if before is None:
        return f"layout: {now}"
    moved = ("" if transition is None
             else f" ({transition['seconds']:.2f} s, {transition['blocks_moved']} block(s) moved)")
    return f"layout after step {step}, {frozen} layer(s) frozen: {_shape(before)} -> {now}{moved}"
