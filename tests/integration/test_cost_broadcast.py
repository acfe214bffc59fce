"""Rank 0's block costs reach every rank whole, on 2 real gloo processes: every rank must plan the same layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from pipetransformer.pipe.cost import BlockCost
from pipetransformer.pipe.profile import broadcast_costs
from process_group import free_port, join, leave

pytestmark = pytest.mark.slow

WORLD = 2
COSTS = [
    BlockCost(forward_s=1.5e-4, backward_s=8e-5, output_bytes=98_816, param_bytes=47_665_152, activation_bytes=198_144,
              forward_fixed_s=3.6e-4, backward_fixed_s=1.86e-2, row_summed_bytes=46_881_792,
              touched_row_bytes_per_sample=98_304),
    BlockCost(forward_s=2.8e-3, backward_s=4.5e-3, output_bytes=98_816, param_bytes=7_097_856,
              activation_bytes=2_360_320, recompute_bytes=2_000_000, forward_fixed_s=1.1e-3, backward_fixed_s=1.2e-3,
              frozen_forward_s=2.2e-3, frozen_forward_fixed_s=0.9e-3),
]
"""The first block's frozen forward was not measured (None): it must arrive as None, the second's as measured."""


def _worker(rank: int, port: int, out: str) -> None:
    join(rank, WORLD, port)
    received = broadcast_costs(COSTS if rank == 0 else None, len(COSTS))
    torch.save(received, f"{out}/rank{rank}.pt")
    leave()


def test_every_field_of_rank_0s_costs_reaches_every_rank(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        received = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert received == COSTS
        assert all(isinstance(cost.param_bytes, int) and isinstance(cost.touched_row_bytes_per_sample, int)
                   for cost in received)
