"""Block handover between 2 real gloo processes: a new owner gets every tensor of a block's training state."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from pipetransformer.config import TrainConfig
from pipetransformer.dp.handover import BlockTransfer, broadcast_blocks, transfer_blocks
from pipetransformer.models.blocks import BlockSequence
from pipetransformer.optim import build_optimizer
from process_group import free_port, join, leave

pytestmark = pytest.mark.slow

WORLD = 2
WIDTH = 4


def _model() -> BlockSequence:
    """Embeddings, a layer with BatchNorm (persistent running statistics), a head."""
    torch.manual_seed(0)
    return BlockSequence(nn.Linear(WIDTH, WIDTH), [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH))],
                         nn.Linear(WIDTH, 2), task="image")


OPTIMIZERS: dict[str, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": lambda params: build_optimizer(params, TrainConfig(optimizer="adamw")),  # the trainer's (fused)
    "sgd-without-momentum": lambda params: build_optimizer(params, TrainConfig(optimizer="sgd", momentum=0.0)),
    "adamw-amsgrad": lambda params: torch.optim.AdamW(params, amsgrad=True),  # an option: max_exp_avg_sq
    "rmsprop-centered": lambda params: torch.optim.RMSprop(params, momentum=0.9, centered=True),  # another optimizer
}
"""Optimizers whose state the handover must carry whole, though it names none of their state keys."""
EXPECTED_STATE_KEYS = {"adamw": {"step", "exp_avg", "exp_avg_sq"},
                       "sgd-without-momentum": set(),  # its momentum_buffer is None: nothing to carry
                       "adamw-amsgrad": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
                       "rmsprop-centered": {"step", "square_avg", "momentum_buffer", "grad_avg"}}


def _train_a_step(model: BlockSequence, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    model(torch.randn(8, WIDTH, device=device)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _worker(rank: int, port: int, out: str, kind: str, device_type: str) -> None:
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device(device_type)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # The trainer's default group (pipetransformer.distributed): CPU tensors over gloo, CUDA ones over NCCL.
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    join(rank, WORLD, port, backend)
    model = _model().to(device)
    optimizer = OPTIMIZERS[kind](model.parameters())
    if rank == 0:  # only the owner trains: rank 1's copy of the model is stale
        for _ in range(2):
            _train_a_step(model, optimizer, device)
    received = transfer_blocks(model, [BlockTransfer(1, 0, 1)], optimizer, rank)  # a handover
    broadcast_blocks(model, {2: 0}, [2])  # as for an evaluation
    names = {p: n for n, p in model.named_parameters()}
    state = {f"model.{k}": v.cpu().clone() for k, v in model.state_dict().items()}
    for param, values in (optimizer.state if rank == 0 else received).items():
        if names[param].startswith("blocks.1."):
            assert all(v.device == param.device for v in values.values()), f"{names[param]}: state off its device"
            state.update({f"optimizer.{names[param]}.{key}": value.cpu().clone() for key, value in values.items()})
    if rank == 1:  # the new owner steps with what it received
        fresh = OPTIMIZERS[kind](model.blocks[1].parameters())
        for param, values in received.items():
            fresh.state[param] = values
        _train_a_step(model, fresh, device)
    torch.save(state, f"{out}/rank{rank}.pt")
    leave()


@pytest.mark.parametrize(("kind", "device"), [
    *((kind, "cpu") for kind in OPTIMIZERS),
    pytest.param("adamw", "cuda", marks=pytest.mark.cuda(devices=WORLD)),
])
def test_a_moved_block_arrives_with_its_buffers_and_optimizer_state(tmp_path: Path, kind: str, device: str) -> None:
    """On CUDA (NCCL) every state tensor must travel on the device on both ends, fused AdamW's step included."""
    mp.spawn(_worker, args=(free_port(), str(tmp_path), kind, device), nprocs=WORLD, join=True)
    owner, new = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD))
    moved = [name for name in owner if name.startswith(("model.blocks.1.", "model.blocks.2.", "optimizer."))]
    assert "model.blocks.1.1.running_mean" in moved and "model.blocks.1.1.num_batches_tracked" in moved
    state_keys = {name.rpartition(".")[2] for name in moved if name.startswith("optimizer.")}
    assert state_keys == EXPECTED_STATE_KEYS[kind]
    for name in moved:
        assert name in new, f"{name} did not arrive"
        assert torch.equal(new[name], owner[name]), f"{name} differs on the new owner"
    assert not torch.equal(new["model.blocks.0.weight"], owner["model.blocks.0.weight"]), "block 0 was not moved"
