"""Gradient synchronisation across the data-parallel replicas of one pipeline stage.

DDP cannot be wrapped around a ``PipelineStage``: on torch 2.x its reducer hits an internal assert at the
second step, and with ``static_graph=True`` it silently computes wrong gradients. Its static membership
does not fit replicas that appear at run time either, so replicas sum their gradients themselves:
trainable parameters only (frozen ones are never all-reduced), flattened into buckets of ``bucket_bytes``
(``dp.bucket_mib``) so each collective is large, and launched asynchronously. With ``overlap`` a bucket
is launched from the autograd hook of its last parameter, while backward still runs on earlier layers,
as DDP does; that needs exactly one backward per step (not a pipeline schedule's one per micro-batch).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from pipetransformer.config import BYTES_PER_MIB, DPConfig

__all__ = ["GradientSync", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = int(DPConfig().bucket_mib * BYTES_PER_MIB)
"""``dp.bucket_mib``'s default, DDP's bucket size."""


class GradientSync:
    """Sums gradients of ``params`` over ``group`` (losses are already scaled by the global batch).

    Parameters without a gradient (a replica that got no samples at an epoch's tail) contribute zeros,
    so every replica always enters the same collectives in the same order.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], group: dist.ProcessGroup | None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = False) -> None:
        self.group = group
        self.params = [p for p in params if p.requires_grad]
        self.buckets: list[list[torch.nn.Parameter]] = []
        current: list[torch.nn.Parameter] = []
        size = 0
        # Reverse order: the last layers' gradients are ready first in backward.
        for param in reversed(self.params):
            current.append(param)
            size += param.numel() * param.element_size()
            if size >= bucket_bytes:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)
        self._pending: dict[int, tuple[torch.Tensor, dist.Work]] = {}
        self._ready: list[int] = [0] * len(self.buckets)
        self._launched = 0  # buckets launched this step (always a prefix of the bucket list)
        self._hooks = []
        if overlap and self.active:
            for index, bucket in enumerate(self.buckets):
                for param in bucket:
                    self._hooks.append(param.register_post_accumulate_grad_hook(self._hook(index)))

    @property
    def active(self) -> bool:
        return self.group is not None and dist.get_world_size(self.group) > 1 and bool(self.params)

    def _hook(self, index: int):  # type: ignore[no-untyped-def]
        def on_grad_ready(_: torch.Tensor) -> None:
            self._ready[index] += 1
            # Collectives must start in the same order on every replica: bucket by bucket.
            while (self._launched < len(self.buckets)
                   and self._ready[self._launched] == len(self.buckets[self._launched])):
                self._launch(self._launched)
        return on_grad_ready

    def _launch(self, index: int) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[index]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        assert work is not None
        self._pending[index] = (flat, work)
        self._launched = index + 1

    def synchronize(self) -> int:
        """Finish the all-reduce of every bucket (launching those no hook launched); returns bytes reduced."""
        if not self.active:
            return 0
        while self._launched < len(self.buckets):
            self._launch(self._launched)
        total = 0
        for index, bucket in enumerate(self.buckets):
            flat, work = self._pending.pop(index)
            work.wait()
            total += flat.numel() * flat.element_size()
            offset = 0
            for param in bucket:
                numel = param.numel()
                chunk = flat[offset:offset + numel].view_as(param)
                if param.grad is None:
                    param.grad = chunk.clone()
                else:
                    param.grad.copy_(chunk)
                offset += numel
        self._ready = [0] * len(self.buckets)
        self._launched = 0
        return total

    def close(self) -> None:
        """Remove the autograd hooks (the layout changed and a new sync takes over)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
