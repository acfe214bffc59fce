"""Applying a freeze to a live model and its optimizer, and measuring the gradients policies watch.

Torch only, no torch.distributed: each rank applies the same decision to the blocks it holds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
from torch import nn

from pipetransformer.models.blocks import BlockSequence

__all__ = ["Blocks", "PreviousGradients", "PreviousWeights", "block_grad_sq_norms", "device_constant", "device_index",
           "drop_from_optimizer", "freeze_blocks", "local_part", "pin_eval", "replica_share"]

DEVICE_CONSTANTS = 64
"""Distinct host-made tensors kept on the device (:func:`device_constant`): a run has a few per layout, and a few
layouts."""


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
    for owner, mirror in model.tied_parameters():  # a tied weight's mirror (in the head) freezes with its owner
        if not owner.requires_grad:
            mirror.requires_grad_(False)
            mirror.grad = None
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


def device_index(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``values`` as an index tensor on ``device``, made once per distinct tuple: a copy from the host waits for a GPU's
    stream, and the blocks a rank measures change only at a layout transition, so a step reuses the tensor."""
    return _device_constant(values, torch.long, device)


def device_constant(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """``values`` as a float64 tensor on ``device``, made once per distinct tuple (as :func:`device_index`): what the
    host knows of a step (which statistics are valid, stop requests) reaches the device without a copy a step."""
    return _device_constant(values, torch.float64, device)


@functools.lru_cache(maxsize=DEVICE_CONSTANTS)
def _device_constant(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def replica_share(blocks: range, replicas: int, replica: int) -> range:
    """The blocks of ``blocks`` that replica ``replica`` of ``replicas`` measures: every ``replicas``-th, from its own
    index on. Replicas hold the same gradients once they are summed, and the same weights, so any of them can measure
    any block: split this way, the freezer's statistics of a step cost each replica a ``replicas``-th of the host time
    one replica measuring every block would wait for, and the control vector's all-reduce puts the shares together."""
    if not 0 <= replica < replicas:
        raise ValueError(f"replica {replica} is not one of {replicas}")
    return range(blocks.start + replica * blocks.step, blocks.stop, blocks.step * replicas)


def _device_of(model: Blocks) -> torch.device:
    """Where ``model``'s statistics live when none of its gradients says: its first parameter's device."""
    parameter = next((p for block in model.blocks for p in block.parameters()), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def block_grad_sq_norms(model: Blocks, blocks: range | None = None) -> torch.Tensor:
    """Per block, the sum of squared gradient entries of its trainable parameters (``[len(model)]`` float64 on the
    model's device; 0 for blocks outside ``blocks``, frozen ones, or ones without gradients).

    One fused norm over every gradient (``torch._foreach_norm``, in each tensor's own dtype as ``clip_grad_norm_``
    computes it), summed per block in float64 by one ``index_add_``, and no copy to the host: a per-tensor loop cost a
    few small ops per parameter, which on a GPU are kernel launches, and a read on the host waits for the GPU. A sharded
    gradient (FSDP2's DTensor) counts its local shard only.
    """
    grads, owners = [], []
    for index in blocks if blocks is not None else range(len(model)):
        for parameter in model.blocks[index].parameters():
            if parameter.requires_grad and parameter.grad is not None:
                grads.append(local_part(parameter.grad))
                owners.append(index)
    device = grads[0].device if grads else _device_of(model)
    norms = torch.zeros(len(model), dtype=torch.float64, device=device)
    if grads:
        with torch.no_grad():
            squares = torch.stack(torch._foreach_norm(grads)).double().square()
        norms.index_add_(0, device_index(tuple(owners), device), squares)
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
        """``(dots, valid)``: per block of ``model``, ``dots`` (``[len(model)]`` float64 on the model's device) holds,
        for the blocks in ``blocks``, the sum over its trainable parameters of ``g_t . g_{t-1}``, and ``valid``
        (``[len(model)]`` float64 on the host: it depends only on which gradients were kept) is 1 where every one of
        them had a previous gradient; then remember this step's gradients."""
        current: dict[nn.Parameter, torch.Tensor] = {}
        measured: list[tuple[int, torch.Tensor]] = []
        with torch.no_grad():
            for index in blocks:
                params = [p for p in model.blocks[index].parameters() if p.requires_grad and p.grad is not None]
                if not params:
                    continue
                grads = {p: local_part(p.grad) for p in params}
                if all(p in self._previous for p in params):
                    measured.append((index, sum(torch.dot(grads[p].reshape(-1), self._previous[p].reshape(-1))
                                                .double() for p in params)))
                for p in params:
                    buffer = self._previous.get(p)
                    current[p] = grads[p].detach().clone() if buffer is None else buffer.copy_(grads[p])
            device = measured[0][1].device if measured else _device_of(model)
            dots = torch.zeros(len(model), dtype=torch.float64, device=device)
            if measured:
                rows = device_index(tuple(index for index, _ in measured), device)
                dots.index_copy_(0, rows, torch.stack([value for _, value in measured]))
        where = {index for index, _ in measured}
        valid = torch.tensor([1.0 if index in where else 0.0 for index in range(len(model))], dtype=torch.float64)
        self._previous = current  # parameters without a gradient this step (frozen, moved away) are forgotten
        return dots, valid


DESCENT_SAMPLE_STRIDE = 32
"""The descent reads every 32nd entry of each parameter and scales the sum up: an unbiased estimate of the dot product
over the whole tensor that touches one float per 64-byte cache line of the last step's weights, not all of them (a
full copy, difference and product of MiniLM's weights, its 11.7M-entry token table included, took ~50 ms of a ~1 s
step on one core). Over 60 steps of MiniLM on Rotten Tomatoes the sampled per-step descents correlated 0.990-0.996 with
the full ones on every layer (0.94 on the embeddings, 0.97 on the head)."""


def _every(tensor: torch.Tensor, stride: int) -> torch.Tensor:
    """Every ``stride``-th entry of ``tensor`` in memory order, as one view: a contiguous tensor's is a single
    ``as_strided`` (flattening and slicing took three view ops a parameter, each a dispatch on the host)."""
    if tensor.is_contiguous():
        return tensor.as_strided((-(-tensor.numel() // stride),), (stride,), tensor.storage_offset())
    return tensor.reshape(-1)[::stride]


def _same_parameters(a: Sequence[nn.Parameter], b: Sequence[nn.Parameter]) -> bool:
    """The very same parameter objects, in order (a block handed over from another rank has new ones)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


@dataclass
class _SampledLayout:
    """Which blocks and parameters one step's descents sampled, where each block's samples sit in the concatenation,
    and the cached views that read the weights' samples (valid while each parameter keeps its storage)."""

    blocks: tuple[tuple[int, tuple[nn.Parameter, ...]], ...]
    segments: dict[int, tuple[int, int]]
    weight_views: list[torch.Tensor]
    storages: tuple[int, ...]
    scale: torch.Tensor
    owners: torch.Tensor


class PreviousWeights:
    """A sample of the trainable weights at the previous step (every ``DESCENT_SAMPLE_STRIDE``-th entry of each
    parameter, concatenated), for the per-block descents the descent freeze policy reads: ``-g_t . (w_t - w_{t-1})``,
    the first-order change of this batch's loss that the block's previous update made (positive: the update lowered
    the loss on a batch it was not computed from), estimated from the sampled entries.

    A step costs one strided view per parameter (its gradient's sample; the weights' views are made once per layout)
    and a few fused ops over every block together: two concatenations, the products, one ``index_add_`` into the
    blocks. A dot product a block took 5 ops a block (on a GPU, kernels), and 0.65 ms of host time against 0.55 on the
    6-layer ViT. No copy to the host. A block whose parameters are not the ones it had at the previous step (the first
    step, a step some got no gradient, a block that just arrived from another rank) has no valid descent for that
    step. A sharded parameter (FSDP2) samples its local shard only: the ranks' descents sum to an estimate of the
    whole one.
    """

    def __init__(self, stride: int = DESCENT_SAMPLE_STRIDE) -> None:
        self.stride = stride
        self._layout: _SampledLayout | None = None
        self._before: torch.Tensor | None = None  # the previous step's samples, in ``_layout``'s order

    def _new_layout(self, blocks: tuple[tuple[int, tuple[nn.Parameter, ...]], ...],
                    storages: tuple[int, ...]) -> _SampledLayout:
        owned = [(index, local_part(p)) for index, params in blocks for p in params]
        weight_views = [_every(tensor, self.stride) for _, tensor in owned]
        taken = [view.numel() for view in weight_views]
        device = weight_views[0].device
        # each sample's weight in the estimate: its tensor's entries over its samples (the stride, or fewer)
        scale = torch.cat([torch.full((n,), tensor.numel() / n, device=device) for (_, tensor), n in zip(owned, taken)])
        owners = torch.cat([torch.full((n,), index, dtype=torch.long, device=device)
                            for (index, _), n in zip(owned, taken)])
        segments, offset, sizes = {}, 0, iter(taken)
        for index, params in blocks:
            end = offset + sum(next(sizes) for _ in params)
            segments[index], offset = (offset, end), end
        return _SampledLayout(blocks, segments, weight_views, storages, scale, owners)

    def block_descents(self, model: Blocks, blocks: range) -> tuple[torch.Tensor, torch.Tensor]:
        """``(descents, valid)``: per block of ``model``, ``descents`` (``[len(model)]`` float64 on the model's device)
        holds, for the blocks in ``blocks``, the estimate of the sum over its trainable parameters of
        ``-g_t . (w_t - w_{t-1})``, and ``valid`` (``[len(model)]`` float64 on the host) is 1 where there is one;
        then remember this step's samples. Call it after the backward and before the optimizer steps."""
        sampled = tuple((index, params) for index in blocks
                        if (params := tuple(p for p in model.blocks[index].parameters()
                                            if p.requires_grad and p.grad is not None)))
        valid = torch.zeros(len(model), dtype=torch.float64)  # on the host: it depends only on which blocks were kept
        if not sampled:
            self._layout = self._before = None
            return torch.zeros(len(model), dtype=torch.float64, device=_device_of(model)), valid
        storages = tuple(local_part(p).data_ptr() for _, params in sampled for p in params)
        previous, before = self._layout, self._before
        same_blocks = previous is not None and len(previous.blocks) == len(sampled) and all(
            i == j and _same_parameters(a, b) for (i, a), (j, b) in zip(previous.blocks, sampled))
        layout = previous if same_blocks and previous.storages == storages else self._new_layout(sampled, storages)
        with torch.no_grad():
            weights = torch.cat(layout.weight_views)
            if not same_blocks:
                # blocks that kept their parameters keep their previous samples; the others compare with themselves
                # (a zero descent) and are not valid this step
                kept = {index: params for index, params in previous.blocks} if previous is not None else {}
                aligned = weights.clone()
                for index, params in sampled:
                    if index in kept and _same_parameters(kept[index], params):
                        start, end = layout.segments[index]
                        old_start, old_end = previous.segments[index]
                        aligned[start:end] = before[old_start:old_end]
                        valid[index] = 1.0
                before = aligned
            else:
                valid[[index for index, _ in sampled]] = 1.0
            gradients = torch.cat([_every(local_part(p.grad), self.stride) for _, params in sampled for p in params])
            products = gradients.mul_(layout.scale).mul_(before - weights)
            descents = torch.zeros(len(model), dtype=torch.float64, device=weights.device)
            descents.index_add_(0, layout.owners, products.double())
        self._layout, self._before = layout, weights
        return descents, valid
