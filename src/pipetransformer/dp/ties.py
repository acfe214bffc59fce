"""Tied weights across pipeline stages: one trained weight (the owner, in the embeddings) and its mirror (in the head).

A decoder that ties its output projection to its token embeddings uses one weight at both ends of the model, so in a
pipeline at the first and the last stage. As Megatron-LM does, each end keeps a parameter; unlike it, only the owner
is trained and holds optimizer state, so a checkpoint, a hand-over and the gradient norm count the weight once:

- after backward, the mirror's gradient is added to the owner's, on the rank holding both or sent point to point from
  the replica's last stage to its first (before the replicas sum the owner's gradient, which then holds the whole
  model's gradient);
- after the update, the owner's new value is copied into the mirror, or sent from the first stage to the last.

While the owner is frozen (with the embeddings) there is nothing to do: both ends hold the value it froze at.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pipetransformer.models.blocks import BlockSequence

__all__ = ["TiedWeightSync"]


class TiedWeightSync:
    """Keeps the mirrors of ``model``'s tied weights equal to their owners on this rank's replica: ``owner_rank``
    holds the embeddings (the replica's first stage), ``mirror_rank`` the head (its last stage)."""

    def __init__(self, model: BlockSequence, rank: int, owner_rank: int, mirror_rank: int) -> None:
        self.pairs = model.tied_parameters()
        self.rank = rank
        self.owner_rank = owner_rank
        self.mirror_rank = mirror_rank

    @property
    def live(self) -> bool:
        """Whether some tied weight trains (a frozen one needs no sync)."""
        return any(owner.requires_grad for owner, _ in self.pairs)

    def fold_gradients(self) -> None:
        """Add each mirror's gradient to its owner's and clear it (every rank of the replica calls)."""
        for owner, mirror in self.pairs:
            if not owner.requires_grad:
                continue
            if self.rank == self.owner_rank == self.mirror_rank:
                if mirror.grad is not None:
                    _accumulate(owner, mirror.grad)
            elif self.rank == self.mirror_rank:
                grad = mirror.grad if mirror.grad is not None else torch.zeros_like(mirror)
                dist.send(grad.contiguous(), dst=self.owner_rank)
            elif self.rank == self.owner_rank:
                received = torch.empty_like(owner)
                dist.recv(received, src=self.mirror_rank)
                _accumulate(owner, received)
            mirror.grad = None

    def refresh_mirrors(self) -> None:
        """Copy each trained owner's value into its mirror, after the update (every rank of the replica calls)."""
        with torch.no_grad():
            for owner, mirror in self.pairs:
                if not owner.requires_grad:
                    continue
                if self.rank == self.owner_rank == self.mirror_rank:
                    mirror.copy_(owner)
                elif self.rank == self.mirror_rank:
                    dist.recv(mirror.data, src=self.owner_rank)
                elif self.rank == self.owner_rank:
                    dist.send(owner.detach().contiguous(), dst=self.mirror_rank)


def _accumulate(parameter: torch.nn.Parameter, grad: torch.Tensor) -> None:
    if parameter.grad is None:
        parameter.grad = grad.clone()
    else:
        parameter.grad.add_(grad)
