"""Gradient synchronisation across the data-parallel replicas of one pipeline stage.

DDP cannot be wrapped around a ``PipelineStage``: on torch 2.x its reducer hits an internal assert at the
second step, and with ``static_graph=True`` it silently computes wrong gradients. Its static membership
does not fit replicas that appear at run time either, so replicas sum their gradients themselves:
trainable parameters only (frozen ones are never all-reduced), flattened into buckets of ``bucket_bytes``
(``dp.bucket_mib``) so each collective is large, and launched asynchronously. With ``overlap`` a bucket
is launched from the autograd hook of its last parameter, while backward still runs on earlier layers,
as DDP does; that needs exactly one backward per step (not a pipeline schedule's one per micro-batch).

A vocabulary-sized embedding table (``dp.touched_rows_only``) is summed by rows instead: only the rows some
replica's gradient has non-zero, found from the gradients themselves. That is exact, since a row that is zero
on every replica sums to zero, and it is most of the bytes: MiniLM's token table is 47 of its 90 MB, of which
a batch of 32 snippets touches a few percent.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipetransformer.config import BYTES_PER_MIB, DPConfig

__all__ = ["DEFAULT_BUCKET_BYTES", "TOUCHED_ROWS_MIN_ROWS", "GradientSync", "row_summed_tables",
           "vocabulary_tables"]

DEFAULT_BUCKET_BYTES = int(DPConfig().bucket_mib * BYTES_PER_MIB)
"""``dp.bucket_mib``'s default, DDP's bucket size."""

TOUCHED_ROWS_MIN_ROWS = 4096
"""Embedding tables with at least this many rows are summed by touched rows: vocabularies (30,522 rows for MiniLM),
not the position and token-type tables, which a batch mostly touches and which are small."""


def vocabulary_tables(modules: Iterable[nn.Module]) -> list[nn.Embedding]:
    """The ``nn.Embedding`` modules with at least :data:`TOUCHED_ROWS_MIN_ROWS` rows and a dense gradient
    (``sparse=True`` tables are not used by the models here)."""
    return [m for m in modules
            if isinstance(m, nn.Embedding) and not m.sparse and m.num_embeddings >= TOUCHED_ROWS_MIN_ROWS]


def row_summed_tables(modules: Iterable[nn.Module], params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
    """The weights among ``params`` of the :func:`vocabulary_tables` in ``modules``."""
    held = {id(p) for p in params}
    return [m.weight for m in vocabulary_tables(modules) if id(m.weight) in held]


class GradientSync:
    """Sums gradients of ``params`` over ``group`` (losses are already scaled by the global batch).

    Parameters without a gradient (a replica that got no samples at an epoch's tail) contribute zeros,
    so every replica always enters the same collectives in the same order. ``row_summed`` (among ``params``)
    are summed by the rows some replica touched, after the buckets are launched.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], group: dist.ProcessGroup | None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = False,
                 row_summed: Sequence[torch.nn.Parameter] = ()) -> None:
        self.group = group
        self.params = [p for p in params if p.requires_grad]
        by_rows = {id(p) for p in row_summed}
        self.row_summed = [p for p in self.params if id(p) in by_rows]
        self.buckets: list[list[torch.nn.Parameter]] = []
        current: list[torch.nn.Parameter] = []
        size = 0
        # Reverse order: the last layers' gradients are ready first in backward.
        for param in reversed([p for p in self.params if id(p) not in by_rows]):
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
        total = sum(self._sum_touched_rows(param) for param in self.row_summed)
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

    def _sum_touched_rows(self, param: torch.nn.Parameter) -> int:
        """Sum ``param``'s gradient over the group in the rows any replica has non-zero (the others are zero on
        every replica, so their sum is too); returns the bytes reduced. Every replica gathers the others' row
        indices (padded to the longest), so all enter the same collectives with the same shapes."""
        grad = param.grad
        if grad is None:
            grad = torch.zeros_like(param)
        mine = grad.reshape(grad.shape[0], -1).ne(0).any(dim=1).nonzero().flatten()
        size = dist.get_world_size(self.group)
        counts = [torch.zeros(1, dtype=torch.int64, device=grad.device) for _ in range(size)]
        dist.all_gather(counts, torch.tensor([mine.numel()], dtype=torch.int64, device=grad.device), group=self.group)
        longest = int(torch.stack(counts).max())
        padded = torch.full((longest,), -1, dtype=torch.int64, device=grad.device)
        padded[:mine.numel()] = mine
        gathered = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(gathered, padded, group=self.group)
        rows = torch.cat(gathered)
        rows = torch.unique(rows[rows >= 0])  # sorted: the same order on every replica
        values = grad.index_select(0, rows)
        if rows.numel():  # the same union everywhere: every replica skips alike
            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.group)
            grad.index_copy_(0, rows, values)
        param.grad = grad
        return values.numel() * values.element_size() + longest * size * padded.element_size()

    def close(self) -> None:
        """Remove the autograd hooks (the layout changed and a new sync takes over, or the run ended) and let go
        of the group, which the hooks would otherwise keep alive with the parameters."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.group = None
