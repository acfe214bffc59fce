"""Classification heads: the last block of a ``BlockSequence``.

A head takes the last layer's activation and returns ``(logits,)``. A model's final norm (pre-norm
encoders such as ViT have one) lives here too, so that every block before the head is a whole layer.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["POOLINGS", "ImageClassificationHead", "TextClassificationHead"]

POOLINGS = ("mean", "cls")
CLASS_TOKEN_INDEX = 0


class TextClassificationHead(nn.Module):
    """Pool a text encoder's hidden states over real tokens, then a linear classifier.

    ``"mean"`` averages only the unpadded tokens (so padding length never changes a prediction);
    ``"cls"`` takes the first token.
    """

    def __init__(
        self,
        hidden_size: int,
        num_labels: int,
        *,
        pooling: str = "mean",
        dropout: float = 0.0,
        final_norm: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {pooling!r}: use one of {', '.join(POOLINGS)}")
        _check_num_labels(num_labels)
        self.pooling = pooling
        self.final_norm = final_norm if final_norm is not None else nn.Identity()
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden_size, num_labels)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor]:
        hidden = self.final_norm(hidden)
        if self.pooling == "cls":
            pooled = hidden[:, CLASS_TOKEN_INDEX]
        else:
            weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
            counts = weights.sum(dim=1).clamp(min=1.0)
            pooled = (hidden * weights).sum(dim=1) / counts
        return (self.classifier(self.dropout(pooled)),)


class ImageClassificationHead(nn.Module):
    """Final norm (if the encoder has one), class token, linear classifier."""

    def __init__(self, hidden_size: int, num_labels: int, *, final_norm: nn.Module | None = None) -> None:
        super().__init__()
        _check_num_labels(num_labels)
        self.final_norm = final_norm if final_norm is not None else nn.Identity()
        self.classifier = nn.Linear(hidden_size, num_labels)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.classifier(self.final_norm(hidden)[:, CLASS_TOKEN_INDEX]),)


def _check_num_labels(num_labels: int) -> None:
    if num_labels < 1:
        raise ValueError(f"num_labels must be at least 1, got {num_labels}: set it to the number of classes")
