"""A built-in causal decoder (GPT-2-shaped: learned positions, pre-norm layers) as a block sequence.

The small decoder that tests and offline runs train from random init. Its activation between blocks is
``(hidden [B, T, dim], attention_mask [B, T])``, as a text encoder's, so a pipeline stage boundary, the activation
cache and the sampler treat it the same way; each layer builds its own causal-and-padding mask from the carried
``attention_mask``. The head is the final norm and the token projection, giving ``(logits [B, T, vocab],)``: the logits
at position ``t`` predict token ``t + 1``. Input and output embeddings are separate weights (no tying), so no weight
is shared across a stage boundary.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F

from pipetransformer.models.blocks import BlockSequence, first_state_difference

__all__ = ["DECODER_SETTINGS", "CausalLayer", "LanguageModelHead", "TokenEmbeddings", "build_decoder", "causal_mask",
           "load_decoder_weights"]

DECODER_SETTINGS = {
    "dim": "width of every layer, divisible by heads (required)",
    "depth": "transformer layers (required)",
    "heads": "attention heads per layer (required)",
    "max_positions": "learned positions: the longest sequence the model takes (required)",
    "mlp_ratio": "MLP hidden width over dim (default 4.0)",
    "dropout": "dropout probability (default 0.0)",
}
"""Every ``build_decoder`` argument but the vocabulary size, and its meaning."""
DEFAULT_MLP_RATIO = 4.0
DEFAULT_DROPOUT = 0.0
INIT_STD = 0.02
QKV = 3
RESIDUALS_PER_LAYER = 2
"""Attention and MLP: each layer adds two residual branches, whose output projections GPT-2 scales down."""


def causal_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, 1, T, T]`` bool, True where query ``i`` may attend key ``j``: ``j <= i`` and ``j`` is a real token. Every
    query also sees itself, so a padding position (whose output no loss reads) never attends to nothing."""
    tokens = attention_mask.shape[1]
    lower = torch.ones(tokens, tokens, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = lower & attention_mask.bool()[:, None, None, :]
    return allowed | torch.eye(tokens, dtype=torch.bool, device=attention_mask.device)


class TokenEmbeddings(nn.Module):
    """Token and learned position embeddings; passes the attention mask on."""

    def __init__(self, vocab_size: int, dim: int, max_positions: int, dropout: float) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Embedding(max_positions, dim)
        nn.init.normal_(self.tokens.weight, std=INIT_STD)
        nn.init.normal_(self.positions.weight, std=INIT_STD)
        self.dropout = nn.Dropout(dropout)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        length = input_ids.shape[1]
        if length > self.max_positions:
            raise ValueError(f"a batch of {length} tokens is longer than the decoder's max_positions "
                             f"{self.max_positions}: lower data.max_length or raise max_positions")
        positions = torch.arange(length, device=input_ids.device)
        hidden = self.tokens(input_ids) + self.positions(positions)
        return self.dropout(hidden), attention_mask


class CausalLayer(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)) under the causal-and-padding mask, then x + mlp(norm(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, dropout: float, residual_std: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout_p = dropout
        self.attention_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, QKV * dim)
        self.attention_out = nn.Linear(dim, dim)
        self.mlp_norm = nn.LayerNorm(dim)
        mlp_dim = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, dim))
        self.dropout = nn.Dropout(dropout)
        for linear in (self.qkv, self.mlp[0]):
            nn.init.normal_(linear.weight, std=INIT_STD)
            nn.init.zeros_(linear.bias)
        for projection in (self.attention_out, self.mlp[2]):
            nn.init.normal_(projection.weight, std=residual_std)
            nn.init.zeros_(projection.bias)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = hidden + self.dropout(self._attend(self.attention_norm(hidden), attention_mask))
        hidden = hidden + self.dropout(self.mlp(self.mlp_norm(hidden)))
        return hidden.contiguous(), attention_mask

    def _attend(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = hidden.shape
        qkv = self.qkv(hidden).view(batch, tokens, QKV, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        dropout = self.dropout_p if self.training else 0.0
        attended = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=causal_mask(attention_mask),
                                                  dropout_p=dropout)
        return self.attention_out(attended.transpose(1, 2).reshape(batch, tokens, dim))


class LanguageModelHead(nn.Module):
    """Final norm and the projection to the vocabulary: next-token logits at every position."""

    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__()
        self.final_norm = nn.LayerNorm(dim)
        self.projection = nn.Linear(dim, vocab_size, bias=False)
        nn.init.normal_(self.projection.weight, std=INIT_STD)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.projection(self.final_norm(hidden)),)


def build_decoder(*, vocab_size: int, dim: int, depth: int, heads: int, max_positions: int,
                  mlp_ratio: float = DEFAULT_MLP_RATIO, dropout: float = DEFAULT_DROPOUT) -> BlockSequence:
    """A randomly initialised causal decoder: ``token + position embeddings, depth layers, norm + projection``; its
    settings are checked first, each error naming what would work."""
    sizes = {"vocab_size": vocab_size, "dim": dim, "depth": depth, "heads": heads, "max_positions": max_positions}
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"decoder {name} must be a positive integer, got {value!r}")
    if dim % heads:
        raise ValueError(f"decoder dim {dim} is not divisible by heads {heads}: use heads in "
                         f"{[d for d in range(1, dim + 1) if dim % d == 0]} or a dim that is a multiple of {heads}")
    if int(dim * mlp_ratio) < 1:
        raise ValueError(f"decoder mlp_ratio {mlp_ratio} gives an empty MLP for dim {dim}: use a positive mlp_ratio "
                         "like 4")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"decoder dropout must be in [0, 1), got {dropout}")
    residual_std = INIT_STD / math.sqrt(RESIDUALS_PER_LAYER * depth)
    layers = [CausalLayer(dim, heads, mlp_ratio, dropout, residual_std) for _ in range(depth)]
    return BlockSequence(TokenEmbeddings(vocab_size, dim, max_positions, dropout), layers,
                         LanguageModelHead(dim, vocab_size), task="text")


def load_decoder_weights(model: BlockSequence, path: str | Path) -> None:
    """Fill ``model`` with an earlier decoder run's weights (its ``model.safetensors``): fine-tuning a decoder
    trained here. The settings must match, which the error says otherwise."""
    if not Path(path).is_file():
        raise ValueError(f"no decoder weights at {path}: give an earlier decoder run's model.safetensors")
    saved = load_file(str(path))
    differing = first_state_difference(saved, model.state_dict())
    if differing is not None:
        raise ValueError(f"the decoder weights at {path} do not fit model.decoder (first difference: {differing}): "
                         "use the model.decoder settings of the run that wrote them")
    model.load_state_dict(saved)

