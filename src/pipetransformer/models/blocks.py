"""The one model abstraction every automation works on: a sequence of blocks.

``embeddings, layer_0 ... layer_{L-1}, head``. Block ``i``'s output is block ``i+1``'s input. What
flows between blocks is an *activation*: a tuple of tensors (for a text encoder ``(hidden, mask)``,
for a ViT ``(hidden,)``), so it can be cut into pipeline stages, sent between processes and cached.
The head returns a 1-tuple ``(logits,)``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

Activation = tuple[torch.Tensor, ...]

__all__ = ["Activation", "BlockSequence", "BlockSplitError", "TiedWeight", "as_activation", "first_state_difference",
           "run_blocks"]


class BlockSplitError(ValueError):
    """A model could not be turned into a block sequence."""


def as_activation(value: torch.Tensor | Sequence[torch.Tensor]) -> Activation:
    """A block's output as a tuple of tensors; anything else cannot cross a process boundary or be cached."""
    if isinstance(value, torch.Tensor):
        return (value,)
    activation = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    for item in activation:
        if not isinstance(item, torch.Tensor):
            raise BlockSplitError(f"a block returned a {type(item).__name__}: blocks must return a tensor or a tuple "
                                  "of tensors (wrap the module so it returns only tensors)")
    return activation


def first_state_difference(saved: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> str | None:
    """The first tensor name that one state has and the other lacks, or whose shapes differ; None when saved weights
    fit a model's state exactly (what loading a file written by another configuration must check first)."""
    found = {name: tuple(t.shape) for name, t in saved.items()}
    wanted = {name: tuple(t.shape) for name, t in expected.items()}
    differing = sorted(set(found) ^ set(wanted)) or sorted(n for n in found if found[n] != wanted[n])
    return differing[0] if differing else None


def _autocast_to(compute_dtype: torch.dtype | None, activation: Activation) -> AbstractContextManager[object]:
    """Autocast to ``compute_dtype`` on the activation's device; None leaves the caller's precision alone."""
    if compute_dtype is None or not activation:
        return nullcontext()
    return torch.autocast(activation[0].device.type, dtype=compute_dtype)


def run_blocks(blocks: Sequence[nn.Module], activation: Activation, recompute: Collection[int] = (),
               compute_dtype: torch.dtype | None = None) -> Activation:
    """Run ``blocks`` in order.

    Blocks whose position is in ``recompute`` keep only their input for backward and run their forward again
    there (non-reentrant activation checkpointing; the RNG state is restored, so dropout draws the same masks
    and the gradients are those of a plain run). ``compute_dtype`` (e.g. bf16) runs them under autocast on the
    activation's device: weights, gradients and optimizer state stay fp32.
    """
    with _autocast_to(compute_dtype, activation):
        for position, block in enumerate(blocks):
            if position in recompute and torch.is_grad_enabled():
                output = checkpoint(block, *activation, use_reentrant=False, preserve_rng_state=True)
            else:
                output = block(*activation)
            activation = as_activation(output)
    return activation


@dataclass(frozen=True)
class ActivationSpec:
    """Per-sample shape and dtype of each tensor of an activation (without the batch dimension)."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    @property
    def bytes_per_sample(self) -> int:
        total = 0
        for shape, dtype in zip(self.shapes, self.dtypes, strict=True):
            numel = 1
            for dim in shape:
                numel *= dim
            total += numel * torch.empty((), dtype=dtype).element_size()
        return total


@dataclass(frozen=True)
class TiedWeight:
    """A weight two blocks use, such as a decoder's token embeddings and its output projection (GPT-2 ties them).

    Pipeline stages may put the two blocks on different ranks, so each block has its own parameter: the ``owner``'s
    (the embeddings', the earlier block) is the weight, trained and kept in the optimizer; the ``mirror`` (in the
    head) is a copy no optimizer holds. After backward the mirror's gradient is added to the owner's, and after the
    update the owner's value is copied into the mirror (``dp.ties``), so training is that of the one tied weight. The
    mirror freezes with its owner. Both are parameter names relative to the block sequence."""

    owner: str
    mirror: str


class BlockSequence(nn.Module):
    """An ordered list of blocks ``embeddings, layers..., head`` with uniform tensor-tuple interfaces.

    ``task`` says what the inputs are (``"text"``: ``(input_ids, attention_mask)``; ``"image"``:
    ``(pixels,)``). Blocks are whole transformer layers, so no block boundary cuts a residual.
    """

    def __init__(self, embeddings: nn.Module, layers: Sequence[nn.Module], head: nn.Module, task: str) -> None:
        super().__init__()
        if len(layers) == 0:
            raise BlockSplitError("a block sequence needs at least one transformer layer")
        self.blocks = nn.ModuleList([embeddings, *layers, head])
        self.task = task
        self.compute_dtype: torch.dtype | None = None  # autocast dtype of every forward (train.precision)
        self.ties: tuple[TiedWeight, ...] = ()

    def tied_parameters(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """Each tie's ``(owner, mirror)`` parameters."""
        return [(self.get_parameter(tie.owner), self.get_parameter(tie.mirror)) for tie in self.ties]

    def mirrors(self) -> set[nn.Parameter]:
        """The parameters that mirror another (no optimizer holds them)."""
        return {mirror for _, mirror in self.tied_parameters()}

    @property
    def num_layers(self) -> int:
        """L, the number of transformer layers (blocks 1..L)."""
        return len(self.blocks) - 2

    def __len__(self) -> int:
        return len(self.blocks)

    def block_names(self) -> list[str]:
        return ["embeddings", *(f"layer_{i}" for i in range(self.num_layers)), "head"]

    def forward_range(self, activation: Activation, start: int, end: int,
                      recompute: Collection[int] = ()) -> Activation:
        """Run blocks ``start .. end-1`` on ``activation``, recomputing the blocks (model indices) in ``recompute``.
        The head's output leaves in fp32, so losses and metrics never see the compute dtype."""
        activation = run_blocks(list(self.blocks)[start:end], activation,
                                [i - start for i in recompute if start <= i < end], self.compute_dtype)
        return (activation[0].float(),) if end == len(self.blocks) else activation

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.forward_range(tuple(inputs), 0, len(self.blocks))[0]
