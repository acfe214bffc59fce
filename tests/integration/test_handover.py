"""Block handover between 2 real gloo processes: a new owner gets every tensor of a block's training state."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from pipetransformer.config import TrainConfig
from pipetransformer.dp.handover import BlockTransfer, broadcast_blocks, transfer_blocks
from pipetransformer.models.blocks import BlockSequence
from pipetransformer.optim import build_optimizer

pytestmark = pytest.mark.slow

WORLD = 2
WIDTH = 4


def _model() -> BlockSequence:
    """Embeddings, a layer with BatchNorm (persistent running statistics), a head."""
    torch.manual_seed(0)
    return BlockSequence(nn.Linear(WIDTH, WIDTH), [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH))],
                         nn.Linear(WIDTH, 2), task="image")


def _train_a_step(model: BlockSequence, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(8, WIDTH)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _worker(rank: int, port: int, out: str, kind: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    model = _model()
    config = TrainConfig(optimizer=kind)
    optimizer = build_optimizer(model.parameters(), config)
    if rank == 0:  # only the owner trains: rank 1's copy of the model is stale
        for _ in range(2):
            _train_a_step(model, optimizer)
    received = transfer_blocks(model, [BlockTransfer(1, 0, 1)], optimizer, kind, rank)  # a handover
    broadcast_blocks(model, {2: 0}, [2])  # as for an evaluation
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    source = optimizer.state if rank == 0 else received
    names = {p: n for n, p in model.named_parameters()}
    for param, values in source.items():
        if names[param].startswith("blocks.1."):
            state.update({f"optimizer.{names[param]}.{key}": value for key, value in values.items()})
    torch.save(state, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_moved_block_arrives_with_its_buffers_and_optimizer_state(tmp_path: Path, kind: str) -> None:
    mp.spawn(_worker, args=(_free_port(), str(tmp_path), kind), nprocs=WORLD, join=True)
    owner, new = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD))
    moved = [name for name in owner if name.startswith(("model.blocks.1.", "model.blocks.2.", "optimizer."))]
    assert "model.blocks.1.1.running_mean" in moved and "model.blocks.1.1.num_batches_tracked" in moved
    assert any(name.startswith("optimizer.") for name in moved)
    for name in moved:
        assert name in new, f"{name} did not arrive"
        assert torch.equal(new[name], owner[name]), f"{name} differs on the new owner"
    assert not torch.equal(new["model.blocks.0.weight"], owner["model.blocks.0.weight"]), "block 0 was not moved"
