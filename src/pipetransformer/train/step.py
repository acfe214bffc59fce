"""A step's forward and backward on this rank, behind one protocol: the only place a pipeline and a single
stage differ.

``LocalStep`` runs the whole active model (one stage): one forward, one backward, and the gradient buckets
are all-reduced over the replicas from backward's hooks, so communication overlaps compute.
``PipelineStep`` runs this rank's stage under a GPipe or 1F1B schedule of micro-batches; the buckets go
after the schedule. The layout builds the right one at every transition (``train.elastic``); the loss is
the task's. Both divide the summed loss by the global batch, so every replica's and micro-batch's
gradient simply adds up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from pipetransformer.data.batch import Batch, IndexedDataset
from pipetransformer.data.text import TextDataset
from pipetransformer.distributed import to_device
from pipetransformer.dp.sync import GradientSync
from pipetransformer.metrics import StepTimer
from pipetransformer.models.blocks import BlockSequence
from pipetransformer.pipe.planner import LayoutPlan, step_micro_batches
from pipetransformer.pipe.stage import PipelineRunner, StageModule
from pipetransformer.train.autocache import AutoCache
from pipetransformer.train.task import BatchSum, Task

__all__ = ["LENGTH_BUCKET", "LocalStep", "PipelineStep", "StepContext", "StepExecutor", "StepResult"]

LENGTH_BUCKET = 8
"""Pipelined text batches are padded up to a multiple of this, so stages see few distinct shapes (a stage fixes
its buffers' shapes at its first step)."""


@dataclass(frozen=True)
class StepContext:
    """What every executor needs besides its place in the layout."""

    model: BlockSequence
    task: Task
    dataset: IndexedDataset  # the training split
    max_length: int  # text: the longest a padded batch gets
    device: torch.device
    prefix: AutoCache  # the activation after the frozen blocks


@dataclass(frozen=True)
class StepResult:
    """What a step leaves for the loop and its records (the same on every rank: from the control vector)."""

    loss: float  # mean over the global batch
    lr: float
    allreduce_bytes: int  # this rank's share of the gradient sync
    layer_grad_norms: list[float]
    layer_grad_dots: list[float | None] | None  # None unless the coherence signal is computed
    layer_descents: list[float | None] | None  # None unless the descent signal is computed
    stop_requested: bool  # some rank got SIGTERM or SIGINT: checkpoint and stop
    interrupted: bool = False  # some rank's stop request was a SIGINT (Ctrl-C)


class StepExecutor(Protocol):
    def load(self, indices: list[int]) -> Batch | None:
        """The batch of this rank's share (None when the share is empty, at an epoch's tail)."""

    def forward_backward(self, batch: Batch, global_rows: int, timer: StepTimer) -> torch.Tensor:
        """Gradients of the loss over ``global_rows`` samples; returns the summed loss this rank computed
        (float64 on the device, unread: zero where no last stage runs)."""

    def synchronize(self) -> int:
        """Finish summing the gradients over the stage's replicas; returns the bytes reduced."""

    def close(self) -> None:
        """Release what the next layout rebuilds (gradient hooks)."""


class LocalStep:
    """The whole active model on this rank: forward from the frozen boundary, backward, buckets from hooks."""

    def __init__(self, context: StepContext, plan: LayoutPlan, sync: GradientSync) -> None:
        self.context = context
        self.plan = plan
        self.sync = sync

    def load(self, indices: list[int]) -> Batch | None:
        return self.context.dataset.get_batch(indices) if indices else None

    def forward_backward(self, batch: Batch, global_rows: int, timer: StepTimer) -> torch.Tensor:
        ctx = self.context
        with timer.phase("forward"):
            activation = ctx.prefix.prefix(batch, self.plan)
            outputs = ctx.model.forward_range(activation, self.plan.frozen_blocks, len(ctx.model),
                                              recompute=self.plan.recomputed_blocks)[0]
            loss = ctx.task.loss(outputs, to_device(ctx.task.targets(batch.labels), ctx.device)) / global_rows
        with timer.phase("backward"):
            loss.backward()
        return loss.detach().double()

    def synchronize(self) -> int:
        return self.sync.synchronize()

    def close(self) -> None:
        self.sync.close()


class _GlobalMeanLoss:
    """The task's summed loss over the step's global batch. A schedule keeps its loss function for good, so the
    step sets ``rows`` before running it."""

    def __init__(self, loss: BatchSum) -> None:
        self.loss = loss
        self.rows = 1

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss(outputs, targets) / self.rows


class PipelineStep:
    """This rank's stage of a pipeline (stage 0 also serves the frozen prefix), micro-batched under a schedule."""

    def __init__(self, context: StepContext, plan: LayoutPlan, stage: int, sync: GradientSync,
                 group: dist.ProcessGroup, schedule: str) -> None:
        self.context = context
        self.plan = plan
        self.stage = stage
        self.sync = sync
        self.schedule = schedule
        stages = plan.layout.num_stages
        start, end = plan.partition.bounds[stage]
        if stage == 0:
            start = max(start, plan.frozen_blocks)
        module = StageModule([context.model.blocks[i] for i in range(start, end)], is_last=stage == stages - 1,
                             recompute=[i - start for i in plan.recomputed_blocks if start <= i < end],
                             compute_dtype=context.model.compute_dtype)
        self.loss = _GlobalMeanLoss(context.task.loss)
        self.runner = PipelineRunner(module, stage, stages, context.device, group, self.loss)

    def load(self, indices: list[int]) -> Batch | None:
        if not indices:
            return None
        dataset = self.context.dataset
        pad = None
        if dataset.task == TextDataset.task:
            longest = int(dataset.lengths[torch.tensor(indices)].max())  # type: ignore[attr-defined]
            pad = min(self.context.max_length, math.ceil(longest / LENGTH_BUCKET) * LENGTH_BUCKET)
        return dataset.get_batch(indices, pad_to=pad)

    def forward_backward(self, batch: Batch, global_rows: int, timer: StepTimer) -> torch.Tensor:
        ctx = self.context
        self.loss.rows = global_rows
        with timer.phase("forward_backward"):
            inputs = ctx.prefix.prefix(batch, self.plan) if self.stage == 0 else None
            micro, schedule = step_micro_batches(len(batch), self.plan.micro_batches, self.plan.layout.num_stages,
                                                 self.schedule)
            text = ctx.dataset.task == TextDataset.task
            shape_key = (len(batch), *(batch.inputs[0].shape[1:2] if text else ()))
            targets = to_device(ctx.task.targets(batch.labels), ctx.device)
            losses = self.runner.step(shape_key, micro, schedule, inputs, targets)
        if not losses:  # not the last stage: no loss here
            return torch.zeros((), dtype=torch.float64, device=ctx.device)
        return torch.stack([loss.detach() for loss in losses]).double().sum()

    def synchronize(self) -> int:
        return self.sync.synchronize()

    def close(self) -> None:
        self.sync.close()
