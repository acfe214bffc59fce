"""A built-in Vision Transformer (Dosovitskiy et al. 2021) as a block sequence.

No package ships pretrained ViT weights that load offline, so the image track trains this small,
dependency-free model from random init, or from a backbone pretrained here (``models.pretrain``).
Layers are pre-norm, so the final LayerNorm sits in the head and every layer block is a whole residual
layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from pipetransformer.models.blocks import BlockSequence, first_state_difference
from pipetransformer.models.heads import ImageClassificationHead

__all__ = [
    "DEFAULT_DROPOUT",
    "DEFAULT_MLP_RATIO",
    "VIT_SETTINGS",
    "PatchEmbeddings",
    "ViTLayer",
    "build_vit",
    "load_vit_backbone",
    "save_vit_backbone",
    "vit_image_shape",
]

VIT_SETTINGS = {
    "image_size": "side of the square input images in pixels (required; image_folder files are resized to it)",
    "patch_size": "side of a square patch, dividing image_size (required)",
    "in_channels": "1 greyscale or 3 RGB (required; image_folder files are converted to it)",
    "dim": "width of every layer, divisible by heads (required)",
    "depth": "transformer layers (required)",
    "heads": "attention heads per layer (required)",
    "mlp_ratio": "MLP hidden width over dim (default 4.0)",
    "dropout": "dropout probability (default 0.0)",
}
"""Every ``model.vit.*`` key (``build_vit``'s arguments but ``num_classes``) and its meaning: the config reference's
rows for the built-in ViT."""
DEFAULT_MLP_RATIO = 4.0
DEFAULT_DROPOUT = 0.0
INIT_STD = 0.02
NUM_CLASS_TOKENS = 1
QKV = 3


class PatchEmbeddings(nn.Module):
    """Non-overlapping patches -> linear projection (a strided conv), class token, learned positions."""

    def __init__(self, image_size: int, patch_size: int, in_channels: int, dim: int, dropout: float) -> None:
        super().__init__()
        self.image_size = image_size
        self.in_channels = in_channels
        self.projection = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)
        num_patches = (image_size // patch_size) ** 2
        self.class_token = nn.Parameter(torch.zeros(1, NUM_CLASS_TOKENS, dim))
        self.position_embeddings = nn.Parameter(torch.zeros(1, num_patches + NUM_CLASS_TOKENS, dim))
        nn.init.trunc_normal_(self.class_token, std=INIT_STD)
        nn.init.trunc_normal_(self.position_embeddings, std=INIT_STD)
        self.dropout = nn.Dropout(dropout)

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.with_class_token(self.patch_tokens(pixels)),)

    def patch_tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[batch, patches, dim]``, patches in row-major order (masked-patch pretraining replaces some)."""
        expected = (self.in_channels, self.image_size, self.image_size)
        if pixels.dim() != len(expected) + 1 or tuple(pixels.shape[1:]) != expected:
            raise ValueError(
                f"pixels have shape {tuple(pixels.shape)}, expected [batch, {', '.join(map(str, expected))}]: "
                "resize the images or build the ViT with matching image_size and in_channels"
            )
        return self.projection(pixels).flatten(2).transpose(1, 2)

    def with_class_token(self, patches: torch.Tensor) -> torch.Tensor:
        """The class token prepended, learned positions added: the first layer's input."""
        class_tokens = self.class_token.expand(patches.shape[0], -1, -1)
        hidden = torch.cat((class_tokens, patches), dim=1) + self.position_embeddings
        return self.dropout(hidden).contiguous()


class ViTLayer(nn.Module):
    """Pre-norm encoder layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout_p = dropout
        self.attention_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, QKV * dim)
        self.attention_out = nn.Linear(dim, dim)
        self.mlp_norm = nn.LayerNorm(dim)
        mlp_dim = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(mlp_dim, dim))
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor]:
        hidden = hidden + self.dropout(self._attend(self.attention_norm(hidden)))
        hidden = hidden + self.dropout(self.mlp(self.mlp_norm(hidden)))
        return (hidden.contiguous(),)

    def _attend(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = hidden.shape
        qkv = self.qkv(hidden).view(batch, tokens, QKV, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        dropout = self.dropout_p if self.training else 0.0
        attended = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], dropout_p=dropout)
        return self.attention_out(attended.transpose(1, 2).reshape(batch, tokens, dim))


def vit_image_shape(vit: dict[str, Any]) -> tuple[int, int, int] | None:
    """``(channels, size, size)`` the ViT of these ``model.vit`` settings takes, or None where they lack one
    (``build_vit`` then names the missing key)."""
    size, channels = vit.get("image_size"), vit.get("in_channels")
    if not isinstance(size, int) or not isinstance(channels, int):
        return None
    return channels, size, size


def build_vit(*, image_size: int, patch_size: int, in_channels: int, dim: int, depth: int, heads: int, num_classes: int,
              mlp_ratio: float = DEFAULT_MLP_RATIO, dropout: float = DEFAULT_DROPOUT) -> BlockSequence:
    """A randomly initialised ViT classifier: ``patch embeddings, depth layers, norm + class token + linear``; its
    settings are checked first, each error naming the values that would work."""
    sizes = {
        "image_size": image_size,
        "patch_size": patch_size,
        "in_channels": in_channels,
        "dim": dim,
        "depth": depth,
        "heads": heads,
        "num_classes": num_classes,
    }
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"vit {name} must be a positive integer, got {value!r}")
    if image_size % patch_size:
        raise ValueError(
            f"vit image_size {image_size} is not divisible by patch_size {patch_size}: "
            f"use a patch_size in {_divisors(image_size)}"
        )
    if dim % heads:
        raise ValueError(
            f"vit dim {dim} is not divisible by heads {heads}: use heads in {_divisors(dim)} "
            f"or a dim that is a multiple of {heads}"
        )
    if int(dim * mlp_ratio) < 1:
        raise ValueError(f"vit mlp_ratio {mlp_ratio} gives an empty MLP for dim {dim}: use a positive mlp_ratio like 4")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"vit dropout must be in [0, 1), got {dropout}")
    layers = [ViTLayer(dim, heads, mlp_ratio, dropout) for _ in range(depth)]
    head = ImageClassificationHead(dim, num_classes, final_norm=nn.LayerNorm(dim))
    return BlockSequence(PatchEmbeddings(image_size, patch_size, in_channels, dim, dropout), layers, head, task="image")


def _backbone_state(model: BlockSequence) -> dict[str, torch.Tensor]:
    head = f"blocks.{len(model) - 1}."
    return {name: tensor for name, tensor in model.state_dict().items() if not name.startswith(head)}


def save_vit_backbone(model: BlockSequence, path: Path) -> None:
    """Every block but the head, as safetensors: a fine-tune brings its own head for its own classes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({name: t.detach().contiguous().cpu() for name, t in _backbone_state(model).items()}, str(path))


def load_vit_backbone(model: BlockSequence, path: str | Path) -> None:
    """Load a backbone saved by ``save_vit_backbone`` into ``model`` (in place; the head keeps its init)."""
    if not Path(path).is_file():
        raise ValueError(f"no ViT backbone at {path}: create one with `pipetransformer pretrain CONFIG --out {path}`")
    saved = load_file(str(path))
    differing = first_state_difference(saved, _backbone_state(model))
    if differing is not None:
        raise ValueError(f"the ViT backbone at {path} does not fit model.vit (first difference: {differing}): "
                         "pretrain with the same model.vit settings")
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name in saved:
                tensor.copy_(saved[name])


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]
