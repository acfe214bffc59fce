"""GradientSync on 2 real gloo processes: bucketed, overlapped with backward, tables by touched rows, equal to a plain
sum."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from pipetransformer.dp.sync import GradientSync, row_summed_tables
from process_group import free_port, join, leave

pytestmark = pytest.mark.slow

WORLD = 2
SMALL_BUCKET_BYTES = 256  # many buckets, so several are launched from hooks during backward


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _worker(rank: int, port: int, out: str, overlap: bool) -> None:
    join(rank, WORLD, port)
    model = _model()
    model[0].weight.requires_grad_(False)  # frozen: must not be reduced
    sync = GradientSync(list(model.parameters()), dist.group.WORLD, bucket_bytes=SMALL_BUCKET_BYTES, overlap=overlap)
    for step in range(2):
        torch.manual_seed(100 * step + rank)
        rows = 0 if (rank == 1 and step == 1) else 4  # a replica with no samples at an epoch's tail
        if rows:
            model(torch.randn(rows, 8)).square().sum().backward()
        reduced = sync.synchronize()
        torch.save({"grads": [p.grad.clone() for p in model.parameters() if p.requires_grad], "bytes": reduced},
                   f"{out}/rank{rank}-step{step}.pt")
        model.zero_grad(set_to_none=True)
    sync.close()
    leave()


@pytest.mark.parametrize("overlap", [False, True])
def test_bucketed_sum_equals_plain_sum(tmp_path: Path, overlap: bool) -> None:
    mp.spawn(_worker, args=(free_port(), str(tmp_path), overlap), nprocs=WORLD, join=True)
    model = _model()
    model[0].weight.requires_grad_(False)
    for step in range(2):
        expected = [torch.zeros_like(p) for p in model.parameters() if p.requires_grad]
        for rank in range(WORLD):
            if rank == 1 and step == 1:
                continue
            torch.manual_seed(100 * step + rank)
            model.zero_grad(set_to_none=True)
            model(torch.randn(4, 8)).square().sum().backward()
            for total, p in zip(expected, [p for p in model.parameters() if p.requires_grad], strict=True):
                total += p.grad
        for rank in range(WORLD):
            saved = torch.load(tmp_path / f"rank{rank}-step{step}.pt", weights_only=True)
            trainable_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
            assert saved["bytes"] == trainable_bytes, "frozen parameters were reduced, or some were not"
            for got, want in zip(saved["grads"], expected, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


VOCAB, WIDTH = 5000, 4
"""A vocabulary-sized table (above TOUCHED_ROWS_MIN_ROWS) so its gradient is summed by touched rows."""


class _Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(VOCAB, WIDTH, padding_idx=0)
        self.positions = nn.Embedding(8, WIDTH)  # small: summed whole, in a bucket
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device)))


def _ids(rank: int, step: int) -> torch.Tensor | None:
    """Rank 0 and 1 share some rows and not others (and the padding row, whose gradient stays 0); rank 1 has no
    samples at step 1 (an epoch's tail)."""
    if rank == 1 and step == 1:
        return None
    generator = torch.Generator().manual_seed(10 * step + rank)
    ids = torch.randint(1, 40, (3, 8), generator=generator) + 1000 * rank
    ids[:, -1] = 0
    return ids


def _table_worker(rank: int, port: int, out: str, overlap: bool, device_type: str) -> None:
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device(device_type)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    join(rank, WORLD, port, backend="nccl" if device.type == "cuda" else "gloo")
    model = _Tagger().to(device)
    params = list(model.parameters())
    sync = GradientSync(params, dist.group.WORLD, bucket_bytes=SMALL_BUCKET_BYTES, overlap=overlap,
                        row_summed=row_summed_tables(model.modules(), params))
    assert sync.row_summed == [model.table.weight]
    for step in range(2):
        ids = _ids(rank, step)
        if ids is not None:
            model(ids.to(device)).square().sum().backward()
        reduced = sync.synchronize()
        torch.save({"grads": [p.grad.cpu() for p in params], "bytes": reduced}, f"{out}/rank{rank}-step{step}.pt")
        model.zero_grad(set_to_none=True)
    sync.close()
    leave()


@pytest.mark.parametrize(("overlap", "device_type"), [
    (False, "cpu"), (True, "cpu"), pytest.param(True, "cuda", marks=pytest.mark.cuda(devices=WORLD))])
def test_a_vocabulary_table_summed_by_touched_rows_equals_the_plain_sum(tmp_path: Path, overlap: bool,
                                                                         device_type: str) -> None:
    mp.spawn(_table_worker, args=(free_port(), str(tmp_path), overlap, device_type), nprocs=WORLD, join=True)
    model = _Tagger()
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for step in range(2):
        expected = [torch.zeros_like(p) for p in model.parameters()]
        for rank in range(WORLD):
            ids = _ids(rank, step)
            if ids is None:
                continue
            model.zero_grad(set_to_none=True)
            model(ids).square().sum().backward()
            for total, p in zip(expected, model.parameters(), strict=True):
                total += p.grad
        for rank in range(WORLD):
            saved = torch.load(tmp_path / f"rank{rank}-step{step}.pt", weights_only=True)
            for got, want in zip(saved["grads"], expected, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
            assert saved["bytes"] < dense_bytes / 10, "the table was reduced whole"
