"""Hugging Face causal language models (GPT-2- and Llama-style) as block sequences.

``model.kind: hf_decoder`` loads ``AutoModelForCausalLM`` from a local directory and splits it into
``token (+ position) embeddings, layers..., final norm + output projection``. The activation between blocks is
``(hidden, attention_mask)``, as the built-in decoder's: each layer block builds the model's own causal-and-padding
mask from the carried int64 mask (``transformers.masking_utils.create_causal_mask``, so eager and sdpa match the
whole model) and, for Llama-style models, the rotary tables from the model's parameter-free rotary module, at
positions ``0..T-1`` (rows are right-padded, as the whole model numbers them).

Tied input and output embeddings (GPT-2, small Qwen2 and Llama 3.2 models) sit in the first and the last block, so
on different pipeline stages: the head gets its own parameter, a *mirror* of the embeddings' weight, declared as a
:class:`~pipetransformer.models.blocks.TiedWeight`, whose gradient is added to the owner's and whose value follows it
after every update (``dp.ties``). The split is checked against the model's own logits on a small padded batch; what
the blocks cannot compute exactly is refused in one line before any worker starts: sliding-window attention,
mixture-of-experts layers, cross-attention, and any model whose split does not reproduce its forward.
"""

from __future__ import annotations

import copy
import itertools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipetransformer.models.blocks import BlockSequence, BlockSplitError, TiedWeight
from pipetransformer.models.hf_blocks import build_mask_once

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase

__all__ = ["DecoderEmbeddings", "DecoderHead", "DecoderLayer", "blocks_from_hf_decoder", "load_hf_decoder",
           "load_decoder_tokenizer", "refuse_unsupported", "token_rows"]

logger = logging.getLogger(__name__)

TOKEN_EMBEDDING_PATHS = ("wte", "embed_tokens")
POSITION_EMBEDDING_PATHS = ("wpe",)
EMBEDDING_DROPOUT_PATHS = ("drop",)
LAYER_LIST_PATHS = ("h", "layers")
FINAL_NORM_PATHS = ("ln_f", "norm")
MOE_SETTINGS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
"""Config fields that give a model mixture-of-experts layers when positive."""
PROBE_ROWS = 2
PROBE_TOKENS = 8
PROBE_PADDED_FROM = 5
PROBE_SEED = 0
PROBE_TOLERANCE = 1e-4
"""Max |difference| from the model's own logits, relative to their largest entry (at least 1)."""


def refuse_unsupported(config: PreTrainedConfig, where: str) -> None:
    """One line for what the blocks cannot compute exactly, from the config alone (before any weights load)."""
    name = f"{where} (model type {config.model_type!r})"
    if getattr(config, "add_cross_attention", False) or getattr(config, "is_encoder_decoder", False):
        raise BlockSplitError(f"cannot split {name}: it has cross-attention (an encoder-decoder model), which the "
                              "blocks do not carry; use a decoder-only model such as GPT-2 or Llama")
    experts = [field for field in MOE_SETTINGS if (getattr(config, field, None) or 0) > 0]
    if experts:
        raise BlockSplitError(f"cannot split {name}: it has mixture-of-experts layers ({experts[0]}="
                              f"{getattr(config, experts[0])}), whose routing the blocks do not support; use a dense "
                              "model")
    layer_types = getattr(config, "layer_types", None) or ()
    sliding = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    if sliding or any(kind != "full_attention" for kind in layer_types):
        raise BlockSplitError(f"cannot split {name}: it has sliding-window (or other non-full) attention, whose masks "
                              "the blocks do not build; set sliding_window to null in its config.json if every "
                              "sequence is shorter than the window, or use a model with full attention")


def token_rows(path: str) -> int:
    """The number of token rows (``vocab_size``) of the causal language model at ``path``, its head's width; a model
    the blocks cannot split exactly is refused here already, from its config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    refuse_unsupported(config, path)
    return int(config.vocab_size)


def load_decoder_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer saved with the model at ``path``; none there is a one-line error."""
    from pipetransformer.models.hf import load_tokenizer

    try:
        return load_tokenizer(path)
    except (OSError, ValueError) as error:
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise ValueError(f"no usable tokenizer at {path} ({first}): save the model's tokenizer there "
                         "(tokenizer.save_pretrained)") from None


def load_hf_decoder(path: str, attn_implementation: str = "sdpa") -> nn.Module:
    """A causal language model from a local directory (never the network), refused first by its config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipetransformer.models.hf import SAFETENSORS_WEIGHTS, quiet_transformers

    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"no Hugging Face model at {path}: give a local directory holding config.json, the "
                                "weights and the tokenizer (models are never downloaded)")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    refuse_unsupported(config, path)
    safetensors = any((Path(path) / name).is_file() for name in SAFETENSORS_WEIGHTS)
    if not safetensors:
        logger.warning("%s has no safetensors weights: loading its pickle-based .bin weights, which can run code "
                       "from the file; load only files you trust", path)
    try:
        with quiet_transformers():
            model: nn.Module = AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, attn_implementation=attn_implementation, use_safetensors=safetensors)
    except ValueError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"cannot load a causal language model from {path}: {first}") from None
    return model


class DecoderEmbeddings(nn.Module):
    """Token embeddings, plus learned positions and dropout where the model has them (GPT-2); passes the mask on."""

    def __init__(self, tokens: nn.Embedding, positions: nn.Embedding | None, dropout: nn.Module | None) -> None:
        super().__init__()
        self.tokens = tokens
        self.positions = positions
        self.dropout = dropout if dropout is not None else nn.Identity()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.tokens(input_ids)
        if self.positions is not None:
            length = input_ids.shape[1]
            if length > self.positions.num_embeddings:
                raise ValueError(f"a batch of {length} tokens is longer than the model's "
                                 f"{self.positions.num_embeddings} positions: lower data.max_length")
            hidden = hidden + self.positions(torch.arange(length, device=input_ids.device))
        return self.dropout(hidden).contiguous(), attention_mask


class DecoderLayer(nn.Module):
    """One of the model's own layers, given the mask (and rotary tables) the whole model would give it."""

    def __init__(self, layer: nn.Module, config: PreTrainedConfig, rotary: nn.Module | None) -> None:
        super().__init__()
        from transformers.masking_utils import create_causal_mask

        self.layer = layer
        self.config = config
        self.rotary = rotary
        self._build_mask = create_causal_mask

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = build_mask_once(self._build_mask, self.config, hidden, attention_mask, cache=None, position_ids=positions)
        extra: dict[str, Any] = {}
        if self.rotary is not None:
            extra["position_embeddings"] = self.rotary(hidden, position_ids=positions)
        output = self.layer(hidden, attention_mask=mask, position_ids=positions, **extra)
        if isinstance(output, tuple):
            output = output[0]
        return output.contiguous(), attention_mask


class DecoderHead(nn.Module):
    """The final norm and the output projection: next-token logits at every position."""

    def __init__(self, final_norm: nn.Module, projection: nn.Linear) -> None:
        super().__init__()
        self.final_norm = final_norm
        self.projection = projection

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.projection(self.final_norm(hidden)),)


def _first(module: nn.Module, paths: tuple[str, ...]) -> nn.Module | None:
    return next((found for found in (getattr(module, path, None) for path in paths) if isinstance(found, nn.Module)),
                None)


def blocks_from_hf_decoder(model: nn.Module) -> BlockSequence:
    """Split a ``*ForCausalLM`` into blocks (its own modules, not copies); a tied output projection becomes a
    declared mirror of the token embeddings. Refused in one line when the split does not reproduce its logits."""
    config = model.config
    name = f"{type(model).__name__} (model type {config.model_type!r})"
    refuse_unsupported(config, type(model).__name__)
    base = getattr(model, "base_model", None)
    tokens, layers = _first(base, TOKEN_EMBEDDING_PATHS), _first(base, LAYER_LIST_PATHS)
    final_norm, projection = _first(base, FINAL_NORM_PATHS), model.get_output_embeddings()
    if not isinstance(tokens, nn.Embedding) or not isinstance(layers, nn.ModuleList) or final_norm is None \
            or not isinstance(projection, nn.Linear):
        raise BlockSplitError(f"cannot split {name}: it is not GPT-2- or Llama-shaped (token embeddings at "
                              f"{'/'.join(TOKEN_EMBEDDING_PATHS)}, layers at {'/'.join(LAYER_LIST_PATHS)}, a final "
                              f"norm at {'/'.join(FINAL_NORM_PATHS)}, a linear output projection)")
    positions = _first(base, POSITION_EMBEDDING_PATHS)
    embeddings = DecoderEmbeddings(tokens, positions if isinstance(positions, nn.Embedding) else None,
                                   _first(base, EMBEDDING_DROPOUT_PATHS))
    rotary = getattr(base, "rotary_emb", None)
    head = DecoderHead(final_norm, projection)
    # Each layer block gets its own copy of the parameter-free rotary module: one shared by all would be put back in
    # training mode by the blocks that train, under a frozen one.
    blocks = BlockSequence(embeddings, [DecoderLayer(layer, config, copy.deepcopy(rotary)) for layer in layers], head,
                           task="text")
    _check_reproduces(model, blocks, name)
    if projection.weight is tokens.weight:
        projection.weight = nn.Parameter(tokens.weight.detach().clone())
        head_index = len(blocks) - 1
        blocks.ties = (TiedWeight(owner="blocks.0.tokens.weight", mirror=f"blocks.{head_index}.projection.weight"),)
    return blocks


def _check_reproduces(model: nn.Module, blocks: BlockSequence, name: str) -> None:
    """Refuse a split whose logits differ from the model's own on a padded batch (real positions, eval mode)."""
    config = model.config
    modes = [(module, module.training) for module in itertools.chain(model.modules(), blocks.modules())]
    model.eval()
    blocks.eval()
    generator = torch.Generator().manual_seed(PROBE_SEED)
    ids = torch.randint(0, config.vocab_size, (PROBE_ROWS, PROBE_TOKENS), generator=generator)
    mask = torch.ones_like(ids)
    mask[-1, PROBE_PADDED_FROM:] = 0
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    try:
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask).logits
            actual = blocks(ids, mask)
    except Exception as error:  # noqa: BLE001 -- whatever fails, the split cannot be trusted
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise BlockSplitError(f"cannot split {name}: its blocks could not be checked against the model's own "
                              f"forward ({type(error).__name__}: {reason})") from error
    finally:
        for module, training in modes:
            module.training = training
    real = mask.bool()
    scale = max(1.0, expected[real].abs().max().item())
    diff = (actual[real] - expected[real]).abs().max().item() if actual.shape == expected.shape else float("inf")
    if not diff <= PROBE_TOLERANCE * scale:
        raise BlockSplitError(f"cannot split {name}: its blocks do not reproduce the model's own logits (max |diff| "
                              f"{diff:.2g} on a padded batch): it computes something outside its embeddings, layers "
                              "and head that is not supported")
