"""Gradient synchronisation across the data-parallel replicas of one pipeline stage.

DDP cannot be wrapped around a ``PipelineStage`` (FINDINGS: wrong gradients or an internal assert), and
its static membership does not fit replicas that appear at run time, so replicas sum their gradients
themselves: trainable parameters only (frozen ones are never all-reduced), flattened into buckets of
``bucket_bytes`` so each collective is large, and launched asynchronously so buckets overlap each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["GradientSync", "SyncStats", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket size


@dataclass
class SyncStats:
    bytes: int = 0
    seconds: float = 0.0


class GradientSync:
    """Sums gradients of ``params`` over ``group`` (losses are already scaled by the global batch).

    Parameters without a gradient (a replica that got no samples at an epoch's tail) contribute zeros,
    so every replica always enters the same collectives in the same order.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], group: dist.ProcessGroup | None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
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

    @property
    def active(self) -> bool:
        return self.group is not None and dist.get_world_size(self.group) > 1 and bool(self.params)

    def synchronize(self) -> int:
        """All-reduce (sum) every bucket; returns the bytes reduced by this rank."""
        if not self.active:
            return 0
        flats: list[tuple[list[torch.nn.Parameter], torch.Tensor, dist.Work]] = []
        total = 0
        for bucket in self.buckets:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads])
            total += flat.numel() * flat.element_size()
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            assert work is not None
            flats.append((bucket, flat, work))
        for bucket, flat, work in flats:
            work.wait()
            offset = 0
            for param in bucket:
                numel = param.numel()
                chunk = flat[offset:offset + numel].view_as(param)
                if param.grad is None:
                    param.grad = chunk.clone()
                else:
                    param.grad.copy_(chunk)
                offset += numel
        return total
