"""Applying a freeze to a live model and its optimizer, and measuring the gradients policies watch.

Torch only, no torch.distributed: each rank applies the same decision to the blocks it holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
from torch import nn

from pipetransformer.models.blocks import BlockSequence

__all__ = ["Blocks", "PreviousGradients", "block_grad_sq_norms", "drop_from_optimizer", "freeze_blocks", "local_part",
           "pin_eval"]


class Blocks(Protocol):
    """What the gradient statistics read: ordered blocks (a :class:`BlockSequence`, or any model's layers in
    ``pipetransformer.integrations``)."""

    @property
    def blocks(self) -> Sequence[nn.Module]: ...

    def __len__(self) -> int: ...


class _PinnedEval:
    """Stands in for a frozen block's ``train`` method so it stays in eval mode whatever mode is asked.

    ``nn.Module.train`` recurses by calling ``child.train(mode)``, so an instance attribute named
    ``train`` intercepts ``model.train()`` at the block without changing its class, its parameter
    names or its state dict. A plain class (not a closure) so the model still pickles and deep-copies.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, mode: bool = True) -> nn.Module:
        for submodule in self.module.modules():
            submodule.training = False
        return self.module


def freeze_blocks(model: BlockSequence, blocks: Iterable[int], optimizer: torch.optim.Optimizer | None) -> int:
    """Freeze whole blocks in place and drop their parameters from ``optimizer``; returns the number of
    scalar parameters newly frozen (0 when the blocks were already frozen).

    Frozen blocks run in eval mode for good (dropout off), so their outputs are deterministic and can be
    cached. Their parameters leave the optimizer's param groups and state, so weight decay and momentum
    cannot move them; every other parameter keeps its state object as it was (Adam moments and step
    count). Param groups that become empty are kept, so group indices (LR schedulers) stay valid.
    """
    indices = sorted(set(blocks))
    head = len(model.blocks) - 1
    invalid = [i for i in indices if not 0 <= i < head]
    if invalid:
        raise ValueError(f"cannot freeze blocks {invalid}: pass blocks 0..{head - 1} (the head never freezes)")
    newly_frozen: list[nn.Parameter] = []
    frozen_ids: set[int] = set()
    for index in indices:
        block = model.blocks[index]
        for parameter in block.parameters():
            frozen_ids.add(id(parameter))
            if parameter.requires_grad:
                newly_frozen.append(parameter)
            parameter.requires_grad_(False)
            parameter.grad = None
        pin_eval(block)
    if optimizer is not None:
        drop_from_optimizer(optimizer, frozen_ids)
    return sum(parameter.numel() for parameter in newly_frozen)


def pin_eval(module: nn.Module) -> None:
    """Put ``module`` in eval mode for good: a later ``model.train()`` leaves it (and its children) in eval."""
    module.train = _PinnedEval(module)  # type: ignore[method-assign]
    module.train(False)


def drop_from_optimizer(optimizer: torch.optim.Optimizer, frozen_ids: set[int]) -> None:
    """Remove the parameters whose ``id`` is in ``frozen_ids`` from ``optimizer``'s groups and state; every other
    parameter keeps its state object, and emptied groups stay (group indices remain valid for LR schedulers)."""
    for group in optimizer.param_groups:
        kept = [parameter for parameter in group["params"] if id(parameter) not in frozen_ids]
        for parameter in group["params"]:
            if id(parameter) in frozen_ids:
                optimizer.state.pop(parameter, None)
        group["params"] = kept


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local shard (FSDP2 keeps each gradient reduce-scattered across the
    ranks), any other tensor as it is. Statistics summed over the ranks' parts then equal the whole tensor's."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def block_grad_sq_norms(model: Blocks, blocks: range | None = None) -> torch.Tensor:
    """Per block, the sum of squared gradient entries of its trainable parameters (``[len(model)]`` float64;
    0 for blocks outside ``blocks``, frozen ones, or ones without gradients).

    A sharded gradient (FSDP2's DTensor) counts its local shard only. Each tensor's norm in its own dtype (as
    ``clip_grad_norm_`` does), summed over tensors in float64: converting every gradient to float64 first cost
    ~80 ms per MiniLM step on one core, against ~12 ms, for a difference in the 4th significant digit that neither
    clipping nor the freeze ratios can see.
    """
    norms = torch.zeros(len(model), dtype=torch.float64)
    with torch.no_grad():
        for index in blocks if blocks is not None else range(len(model)):
            grads = [p.grad for p in model.blocks[index].parameters() if p.requires_grad and p.grad is not None]
            if grads:
                norms[index] = sum(torch.linalg.vector_norm(local_part(g)).double().square() for g in grads)
    return norms


class PreviousGradients:
    """Each trainable parameter's gradient of the previous step, for the per-block dot products ``g_t . g_{t-1}``
    the coherence freeze policy reads.

    Costs one gradient-sized buffer per trainable parameter held, and a copy per step. A parameter whose
    previous gradient is unknown (the first step, a step it got no gradient, a block that just arrived from
    another rank) gives its block no valid dot product for that step. A sharded gradient (FSDP2) keeps and
    multiplies its local shard only: the ranks' dot products sum to the whole one.
    """

    def __init__(self) -> None:
        self._previous: dict[nn.Parameter, torch.Tensor] = {}

    def block_dots(self, model: Blocks, blocks: range) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dots, valid)``, both ``[len(model)]`` float64: per block in ``blocks``, the sum over its trainable
        parameters of ``g_t . g_{t-1}`` and 1 where every one of them had a previous gradient (else 0); then
        remember this step's gradients."""
        dots = torch.zeros(len(model), dtype=torch.float64)
        valid = torch.zeros(len(model), dtype=torch.float64)
        current: dict[nn.Parameter, torch.Tensor] = {}
        with torch.no_grad():
            for index in blocks:
                params = [p for p in model.blocks[index].parameters() if p.requires_grad and p.grad is not None]
                if not params:
                    continue
                grads = {p: local_part(p.grad) for p in params}
                if all(p in self._previous for p in params):
                    dots[index] = sum(torch.dot(grads[p].reshape(-1), self._previous[p].reshape(-1)).double()
                                      for p in params)
                    valid[index] = 1.0
                for p in params:
                    buffer = self._previous.get(p)
                    current[p] = grads[p].detach().clone() if buffer is None else buffer.copy_(grads[p])
        self._previous = current  # parameters without a gradient this step (frozen, moved away) are forgotten
        return dots, valid
