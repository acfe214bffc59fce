"""Training-state handover between ranks when the layout changes (AutoDP) and for evaluation/checkpoints.

Every rank builds the whole block sequence at start (same seed or same pretrained weights), but only the
blocks it *holds* are trained there; the others go stale. A block's state is its parameters and persistent
buffers plus the optimizer state of its trainable parameters. When a rank starts holding a block, the block's current
state is sent to it point to point from a rank that held it, so a new replica is indistinguishable from
an old one. Everything is sent as tensors with shapes both sides know: nothing is pickled.

Where state lives is one rule, :func:`place_state`: every tensor of a block's state, optimizer state
included, on the device of its parameter (the stage's device). Both ends of every transfer then hold the
tensor on the same kind of device, so they use the same transport of the default group (NCCL for CUDA
tensors, gloo for CPU ones); what only describes the payload (sizes, JSON) is a CPU tensor on both ends.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from pipetransformer.faults import maybe_fail
from pipetransformer.models.blocks import BlockSequence
from pipetransformer.pipe.layout import transfer_plan

if TYPE_CHECKING:
    from pipetransformer.pipe.planner import LayoutPlan

__all__ = ["BlockTransfer", "hand_over", "transfer_blocks", "broadcast_blocks", "block_tensors", "describe_state",
           "place_state",
           "state_tensors"]

@dataclass(frozen=True)
class BlockTransfer:
    block: int
    src: int
    dst: int


@dataclass(frozen=True)
class _HeldBlocks:
    """A plan's stages as the blocks their ranks hold, the prefix included: what a handover must move."""

    bounds: list[tuple[int, int]]


def hand_over(model: BlockSequence, previous: LayoutPlan, plan: LayoutPlan, optimizer: torch.optim.Optimizer,
              rank: int) -> tuple[dict[nn.Parameter, dict[str, torch.Tensor]], int]:
    """AutoDP's handover from ``previous`` to ``plan`` (every rank must call): each block goes, with its optimizer
    state, to every rank that holds it under ``plan`` and did not before (which rank sends which:
    :func:`~pipetransformer.pipe.layout.transfer_plan`). Returns the optimizer state received and the blocks moved."""
    transfers = [BlockTransfer(t.block, t.src_rank, t.dst_rank) for t in transfer_plan(
        _HeldBlocks(previous.held_bounds()), previous.layout, _HeldBlocks(plan.held_bounds()), plan.layout)]
    maybe_fail("handover", rank)
    return transfer_blocks(model, transfers, optimizer, rank), len(transfers)


def place_state(param: torch.Tensor, state: Mapping[str, Any]) -> dict[str, Any]:
    """``param``'s optimizer state with every tensor on ``param``'s device, as fused AdamW keeps even its ``step``:
    what a handover sends and receives, and what a checkpoint's CPU tensors become when restored."""
    return {key: value.to(param.device) if isinstance(value, torch.Tensor) else value for key, value in state.items()}


def block_tensors(model: BlockSequence, block: int) -> list[torch.Tensor]:
    """A block's state as its ``state_dict`` has it, in one order on every rank: parameters and persistent
    buffers (running statistics train too); a tensor tied under two names once."""
    tensors: dict[int, torch.Tensor] = {}
    for tensor in model.blocks[block].state_dict(keep_vars=True).values():
        tensors.setdefault(id(tensor), tensor)
    return list(tensors.values())


def transfer_blocks(model: BlockSequence, transfers: Sequence[BlockTransfer], optimizer: torch.optim.Optimizer | None,
                    rank: int, group: dist.ProcessGroup | None = None) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
    """Send/receive blocks' parameters and buffers (in place) and optimizer state; returns the received state.

    Three rounds of batched p2p: the sizes of the senders' JSON descriptions of their optimizer state (which
    tensors of the block have state, under which keys, with which shapes and dtypes: whatever the optimizer
    keeps, so no optimizer or option needs to be known here), the descriptions, then the payload. The caller
    installs the returned state into the optimizer it rebuilds for the new layout.
    """
    mine = [t for t in transfers if rank in (t.src, t.dst) and t.src != t.dst]
    if not mine:
        return {}
    state = optimizer.state if optimizer is not None else {}
    tensors = {t: block_tensors(model, t.block) for t in mine}

    headers: dict[BlockTransfer, torch.Tensor] = {}
    sizes: dict[BlockTransfer, torch.Tensor] = {}
    ops = []
    for transfer in mine:
        if transfer.src == rank:
            described = [describe_state(t, state[t]) if t in state else None for t in tensors[transfer]]
            headers[transfer] = torch.tensor(list(json.dumps(described).encode()), dtype=torch.uint8)
            sizes[transfer] = torch.tensor([headers[transfer].numel()], dtype=torch.int64)
            ops.append(dist.P2POp(dist.isend, sizes[transfer], transfer.dst, group))
        else:
            sizes[transfer] = torch.zeros(1, dtype=torch.int64)
            ops.append(dist.P2POp(dist.irecv, sizes[transfer], transfer.src, group))
    _run(ops)
    ops = []
    for transfer in mine:
        if transfer.src == rank:
            ops.append(dist.P2POp(dist.isend, headers[transfer], transfer.dst, group))
        else:
            headers[transfer] = torch.empty(int(sizes[transfer].item()), dtype=torch.uint8)
            ops.append(dist.P2POp(dist.irecv, headers[transfer], transfer.src, group))
    _run(ops)

    received: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
    ops = []
    for transfer in mine:
        sending = transfer.src == rank
        peer = transfer.dst if sending else transfer.src
        described = json.loads(bytes(headers[transfer].tolist()))
        for tensor, entries in zip(tensors[transfer], described, strict=True):
            ops.append(dist.P2POp(dist.isend if sending else dist.irecv, tensor.data, peer, group))
            if entries is None:
                continue
            if sending:
                placed = place_state(tensor, state[tensor])
                values = [placed[key].contiguous() for key, _, _ in entries]
            else:
                slot = {key: torch.empty(shape, dtype=getattr(torch, dtype), device=tensor.device)
                        for key, shape, dtype in entries}
                received[tensor] = slot
                values = list(slot.values())
            ops.extend(dist.P2POp(dist.isend if sending else dist.irecv, value, peer, group) for value in values)
    _run(ops)
    return received


def state_tensors(param: torch.Tensor, state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """One parameter's optimizer state exactly as the optimizer keeps it, by key, whatever the optimizer and
    its options. A value of ``None`` counts as absent (torch's optimizers read optional state with ``get``);
    anything else that is not a tensor cannot be sent or saved, and says so instead of being dropped."""
    tensors = {}
    for key, value in state.items():
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"optimizer state {key!r} of a {tuple(param.shape)} parameter is a "
                            f"{type(value).__name__}: only tensors can be handed over or checkpointed; use an "
                            "optimizer that keeps its state in tensors")
        tensors[key] = value
    return tensors


def describe_state(param: torch.Tensor, state: Mapping[str, Any]) -> list[tuple[str, list[int], str]] | None:
    """``[(key, shape, dtype), ...]`` of :func:`state_tensors`, for the receiver's buffers; ``None`` if empty."""
    entries = [(key, list(value.shape), str(value.dtype).removeprefix("torch."))
               for key, value in state_tensors(param, state).items()]
    return entries or None


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
