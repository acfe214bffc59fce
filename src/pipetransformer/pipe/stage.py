"""Glue between the block sequence and ``torch.distributed.pipelining``.

A stage is a contiguous range of blocks. ``PipelineStage`` fixes its communication buffers' shapes at the
first step, so one stage + schedule is kept per input shape (text batches are trimmed to their longest
sequence, rounded up to a bucket, so there are few shapes) and reused.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from pipetransformer.models.blocks import Activation, run_blocks

__all__ = ["StageModule", "PipelineRunner"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class StageModule(nn.Module):
    """Blocks ``[start, end)`` of the model as one pipeline stage.

    The last stage unwraps the head's 1-tuple so the schedule's loss function gets the logits tensor, in fp32
    whatever ``compute_dtype`` ran the blocks. ``recompute``: positions (in ``blocks``) of the blocks that keep
    only their input for backward.
    """

    def __init__(self, blocks: Sequence[nn.Module], is_last: bool, recompute: Collection[int] = (),
                 compute_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.is_last = is_last
        self.recompute = tuple(recompute)
        self.compute_dtype = compute_dtype

    def forward(self, *activation: torch.Tensor) -> torch.Tensor | Activation:
        out = run_blocks(list(self.blocks), tuple(activation), self.recompute, self.compute_dtype)
        if self.is_last:
            return out[0].float()
        return tuple(t.contiguous() for t in out)


@dataclass(eq=False)
class PipelineRunner:
    """Runs one training step of this rank's stage under a GPipe or 1F1B schedule."""

    module: StageModule
    stage_index: int
    num_stages: int
    device: torch.device
    group: dist.ProcessGroup
    loss_fn: LossFn
    _schedules: dict[tuple[object, ...], object] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        # Imported when a pipeline is built (before a run's clock starts), not with this module: ~2 s of a 2-core VM
        # that processes which never pipeline skip (the launcher's pre-flight child, one worker, replicas alone).
        from torch.distributed import pipelining

        self._pipelining = pipelining

    def _schedule(self, shape_key: tuple[int, ...], micro_batches: int, schedule: str) -> object:
        key = (*shape_key, micro_batches, schedule)
        if key not in self._schedules:
            schedules = {"gpipe": self._pipelining.ScheduleGPipe,  # a step may run GPipe under 1F1B
                         "1f1b": self._pipelining.Schedule1F1B}
            stage = self._pipelining.PipelineStage(self.module, self.stage_index, self.num_stages, self.device,
                                                   group=self.group)
            # Losses are sums scaled by the global batch, so micro-batch gradients must simply add up.
            self._schedules[key] = schedules[schedule](stage, micro_batches, loss_fn=self.loss_fn, scale_grads=False)
        return self._schedules[key]

    def step(self, shape_key: tuple[int, ...], micro_batches: int, schedule: str, inputs: Activation | None,
             target: torch.Tensor | None) -> list[torch.Tensor]:
        """Forward + backward of all micro-batches under ``schedule`` (gpipe / 1f1b). Returns the
        per-micro-batch losses (last stage only).

        ``shape_key``, ``micro_batches`` and ``schedule`` must be equal on every stage of the pipeline for the
        same step (``shape_key``: e.g. the batch's row count and sequence length), since they select the
        stage's fixed-shape buffers and the order of its sends and receives.
        """
        runner = self._schedule(shape_key, micro_batches, schedule)
        losses: list[torch.Tensor] = []
        is_first = self.stage_index == 0
        is_last = self.stage_index == self.num_stages - 1
        args = inputs if is_first and inputs is not None else ()
        kwargs: dict[str, object] = {}
        if is_last:
            kwargs = {"target": target, "losses": losses}
        runner.step(*args, **kwargs)  # type: ignore[attr-defined]
        return losses
