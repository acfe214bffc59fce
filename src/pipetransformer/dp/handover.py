"""Training-state handover between ranks when the layout changes (AutoDP) and for evaluation/checkpoints.

Every rank builds the whole block sequence at start (same seed or same pretrained weights), but only the
blocks it *holds* are trained there; the others go stale. A block's state is its parameters and persistent
buffers plus the optimizer state of its trainable parameters. When a rank starts holding a block, the block's current
state is sent to it point to point from a rank that held it, so a new replica is indistinguishable from
an old one. Everything is sent as tensors with shapes both sides know: nothing is pickled.

Where state lives is one rule, :func:`place_state`: every tensor of a block's state, optimizer state
included, on the device of its parameter (the stage's device). Both ends of every transfer then hold the
tensor on the same kind of device, so they use the same transport of the default group (NCCL for CUDA
tensors, gloo for CPU ones); what only describes the payload (flags) is a CPU tensor on both ends.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..models.blocks import BlockSequence

__all__ = ["BlockTransfer", "OPTIMIZER_STATE_KEYS", "transfer_blocks", "broadcast_blocks", "block_tensors",
           "place_state"]

OPTIMIZER_STATE_KEYS: dict[str, tuple[str, ...]] = {
    "adamw": ("step", "exp_avg", "exp_avg_sq"),
    "sgd": ("momentum_buffer",),
}
"""Per optimizer, the state tensors a trainable parameter carries (``step`` is a scalar)."""


@dataclass(frozen=True)
class BlockTransfer:
    block: int
    src: int
    dst: int


def place_state(param: torch.Tensor, state: Mapping[str, Any]) -> dict[str, Any]:
    """``param``'s optimizer state with every tensor on ``param``'s device, as fused AdamW keeps even its ``step``:
    what a handover sends and receives, and what a checkpoint's CPU tensors become when restored."""
    return {key: value.to(param.device) if isinstance(value, torch.Tensor) else value for key, value in state.items()}


def _state_template(param: nn.Parameter, key: str) -> torch.Tensor:
    if key == "step":
        return torch.zeros((), dtype=torch.float32, device=param.device)
    return torch.empty_like(param)


def block_tensors(model: BlockSequence, block: int) -> list[torch.Tensor]:
    """A block's state as its ``state_dict`` has it, in one order on every rank: parameters and persistent
    buffers (running statistics train too); a tensor tied under two names once."""
    tensors: dict[int, torch.Tensor] = {}
    for tensor in model.blocks[block].state_dict(keep_vars=True).values():
        tensors.setdefault(id(tensor), tensor)
    return list(tensors.values())


def transfer_blocks(model: BlockSequence, transfers: Sequence[BlockTransfer], optimizer: torch.optim.Optimizer | None,
                    optimizer_kind: str, rank: int, group: dist.ProcessGroup | None = None
                    ) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
    """Send/receive blocks' parameters (in place) and optimizer state; returns the received state.

    Two rounds of batched p2p: first which trainable parameters have optimizer state (flags), then the
    payload. The caller installs the returned state into the optimizer it rebuilds for the new layout.
    """
    keys = OPTIMIZER_STATE_KEYS[optimizer_kind]
    mine = [t for t in transfers if rank in (t.src, t.dst) and t.src != t.dst]
    if not mine:
        return {}
    state = optimizer.state if optimizer is not None else {}

    flags: dict[BlockTransfer, torch.Tensor] = {}
    ops = []
    for transfer in mine:
        params = block_tensors(model, transfer.block)
        if transfer.src == rank:
            flag = torch.tensor([1 if p.requires_grad and p in state and state[p] else 0 for p in params],
                                dtype=torch.int64)
            ops.append(dist.P2POp(dist.isend, flag, transfer.dst, group))
        else:
            flag = torch.zeros(len(params), dtype=torch.int64)
            ops.append(dist.P2POp(dist.irecv, flag, transfer.src, group))
        flags[transfer] = flag
    _run(ops)

    received: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
    ops = []
    for transfer in mine:
        params = block_tensors(model, transfer.block)
        sending = transfer.src == rank
        peer = transfer.dst if sending else transfer.src
        for param, has_state in zip(params, flags[transfer].tolist(), strict=True):
            ops.append(dist.P2POp(dist.isend if sending else dist.irecv, param.data, peer, group))
            if not has_state:
                continue
            if sending:
                placed = place_state(param, state[param])
                for key in keys:
                    ops.append(dist.P2POp(dist.isend, placed[key].contiguous(), peer, group))
            else:
                slot = {key: _state_template(param, key) for key in keys}
                received[param] = slot
                for key in keys:
                    ops.append(dist.P2POp(dist.irecv, slot[key], peer, group))
    _run(ops)
    return received


def _run(ops: list[dist.P2POp]) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def broadcast_blocks(model: BlockSequence, owners: dict[int, int], blocks: Iterable[int],
                     group: dist.ProcessGroup | None = None) -> None:
    """Give every rank of ``group`` the current parameters of ``blocks`` from their ``owners`` (global ranks)."""
    for block in blocks:
        for param in block_tensors(model, block):
            dist.broadcast(param.data, src=owners[block], group=group)
