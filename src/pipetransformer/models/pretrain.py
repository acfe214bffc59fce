"""Masked-patch pretraining of the built-in ViT (SimMIM, Xie et al. 2022) on unlabeled training images.

Freezing costs little when the bottom layers start out converged, as in the paper's pretrained ViT; no
package ships pretrained ViT weights offline, so the image track makes its own backbone. A random part of
the patch embeddings is replaced by a learned mask token and a linear decoder predicts those patches'
pixels from the last layer's output. The backbone (every block but the head) is saved for ``model.path``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from pipetransformer.config import TrainConfig
from pipetransformer.models.blocks import BlockSequence
from pipetransformer.models.vit import INIT_STD, PatchEmbeddings
from pipetransformer.optim import build_optimizer, lr_at, set_lr

__all__ = ["DEFAULT_MASK_RATIO", "masked_patch_pretrain"]

DEFAULT_MASK_RATIO = 0.5


class _MaskedPatchObjective(nn.Module):
    """The mask token and pixel decoder around a ViT's embeddings and layers (the head is not used)."""

    def __init__(self, model: BlockSequence, mask_ratio: float) -> None:
        super().__init__()
        embeddings = model.blocks[0]
        if not isinstance(embeddings, PatchEmbeddings):
            raise ValueError("masked-patch pretraining needs the built-in ViT: set model.kind: vit")
        self.embeddings = embeddings
        self.layers = nn.ModuleList(list(model.blocks)[1:-1])
        self.patch = int(embeddings.projection.kernel_size[0])
        dim = embeddings.projection.out_channels
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        nn.init.trunc_normal_(self.mask_token, std=INIT_STD)
        self.decoder = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, embeddings.in_channels * self.patch**2))
        self.mask_ratio = mask_ratio

    def forward(self, pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Mean squared error on the masked patches' pixels."""
        patch = self.patch
        targets = pixels.unfold(2, patch, patch).unfold(3, patch, patch)  # [B, C, rows, cols, p, p]
        targets = targets.permute(0, 2, 3, 1, 4, 5).flatten(3).flatten(1, 2)  # [B, patches, C p p], row-major
        tokens = self.embeddings.patch_tokens(pixels)
        # Drawn from a CPU generator on every device, so a seed masks the same patches on CPU and CUDA.
        masked = (torch.rand(tokens.shape[:2], generator=generator) < self.mask_ratio).to(tokens.device)
        tokens = torch.where(masked[..., None], self.mask_token.expand_as(tokens), tokens)
        hidden = self.embeddings.with_class_token(tokens)
        for layer in self.layers:
            hidden = layer(hidden)[0]
        predicted = self.decoder(hidden[:, 1:])
        return F.mse_loss(predicted[masked], targets[masked])


def masked_patch_pretrain(model: BlockSequence, pixels: torch.Tensor, train: TrainConfig, *, epochs: int, seed: int,
                          mask_ratio: float = DEFAULT_MASK_RATIO,
                          on_epoch: Callable[[int, float, float], None] | None = None) -> list[float]:
    """Pretrain ``model``'s embeddings and layers in place on ``pixels`` ``[N, C, H, W]``; returns each epoch's
    mean loss. Batch size, learning-rate schedule, weight decay and clipping come from ``train``. Runs on the
    model's device; ``pixels`` may stay on the host (each batch is moved)."""
    if not 0.0 < mask_ratio < 1.0:
        raise ValueError(f"mask_ratio must be in (0, 1), got {mask_ratio}")
    device = next(model.parameters()).device
    objective = _MaskedPatchObjective(model, mask_ratio).to(device)
    params = [p for p in objective.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, train)
    generator = torch.Generator().manual_seed(seed)
    steps_per_epoch = max(1, len(pixels) // train.batch_size)
    total = epochs * steps_per_epoch
    losses: list[float] = []
    started = time.perf_counter()
    model.train()
    for epoch in range(epochs):
        order = torch.randperm(len(pixels), generator=generator)
        epoch_loss = 0.0
        for index in range(steps_per_epoch):
            step = epoch * steps_per_epoch + index
            batch = pixels[order[index * train.batch_size:(index + 1) * train.batch_size]].to(device)
            loss = objective(batch, generator)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if train.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(params, train.grad_clip)
            set_lr(optimizer, lr_at(step, total, train))
            optimizer.step()
            epoch_loss += float(loss.detach())
        mean = epoch_loss / steps_per_epoch
        if not math.isfinite(mean):
            raise ValueError(f"the masked-patch loss became {mean} in epoch {epoch + 1}: lower train.lr")
        losses.append(mean)
        if on_epoch is not None:
            on_epoch(epoch, mean, time.perf_counter() - started)
    return losses
