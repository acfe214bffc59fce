"""Models the planner can predict for, described by their dimensions rather than built.

A :class:`ModelSpec` gives per-block work (:func:`~pipetransformer.pipe.cost.analytic_work`) and from
it per-block costs on a device in a precision, and the per-block FLOPs, parameter, activation and
optimizer bytes that ``pipetransformer plan --model`` prints. It comes from a built-in size or from a
Hugging Face ``config.json`` (any BERT- or ViT-style encoder).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipetransformer.pipe.cost import (
    ADAMW_STATE_FACTOR,
    FLOAT_BYTES,
    BlockCost,
    BlockWork,
    Precision,
    analytic_work,
    costs_from_work,
)
from pipetransformer.plan.cluster import GIGA, Device, read_json_file

__all__ = ["BUILT_IN_MODELS", "ModelSpec", "ModelSpecError", "load_model_spec", "model_from_hf_config"]

VIT_IMAGE_SIZE = 224
VIT_PATCH_SIZE = 16
RGB_CHANNELS = 3
IMAGENET_CLASSES = 1000
SPAN_OUTPUTS = 2
"""A question-answering head predicts a start and an end logit per token."""

BERT_VOCAB = 30522
BERT_SQUAD_SEQ_LEN = 384
"""The sequence length SQuAD fine-tuning of BERT usually uses (Devlin et al., 2019)."""

BERT_BASE_SEQ_LEN = 128
MINILM_SEQ_LEN = 64
"""This project's ``data.max_length`` default, at which MiniLM is fine-tuned here."""

DEFAULT_TEXT_OUTPUTS = 2
DEFAULT_TEXT_SEQ_LEN = 128


class ModelSpecError(ValueError):
    """A model description that cannot be used; the message names the field and what to change."""


def _vit_seq_len(image_size: int, patch_size: int) -> int:
    return (image_size // patch_size) ** 2 + 1  # patches + class token


@dataclass(frozen=True)
class ModelSpec:
    """An encoder's dimensions: ``embeddings, layer_0..layer_{L-1}, head``.

    ``input_width`` is what the embeddings block reads per position: the vocabulary of a text model
    (a lookup) or the pixels of one patch of a ViT (a matmul).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    seq_len: int
    input_width: int
    num_outputs: int
    is_text: bool

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "intermediate_size", "seq_len", "input_width",
                      "num_outputs"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelSpecError(f"model {self.name}: {field} must be an integer >= 1, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ModelSpecError(f"model {self.name}: hidden_size={self.hidden_size} is not a multiple of "
                                 f"num_heads={self.num_heads}: fix one of them")

    @property
    def num_blocks(self) -> int:
        return self.num_layers + 2

    def with_seq_len(self, seq_len: int) -> ModelSpec:
        return replace(self, seq_len=seq_len)

    def work(self) -> list[BlockWork]:
        return analytic_work(
            num_layers=self.num_layers, hidden_size=self.hidden_size, seq_len=self.seq_len,
            num_heads=self.num_heads, vocab_size=self.input_width, num_classes=self.num_outputs,
            mlp_ratio=self.intermediate_size / self.hidden_size, embedding_is_lookup=self.is_text,
            carries_attention_mask=self.is_text,
        )

    def costs(self, device: Device, precision: Precision) -> list[BlockCost] | None:
        """Per-sample block costs on ``device`` in ``precision``; None if the device lacks that precision."""
        flops = device.flops(precision)
        if flops is None:
            return None
        return costs_from_work(self.work(), flops_per_second=flops, memory_bytes_per_second=device.memory_bytes_per_s,
                               precision=precision)

    def block_names(self) -> list[str]:
        return ["embeddings", *(f"layer_{i}" for i in range(self.num_layers)), "head"]

    def describe_blocks(self, precision: Precision = Precision.FP32,
                        optimizer_state_factor: int = ADAMW_STATE_FACTOR) -> list[dict[str, Any]]:
        """Per block and per sample: forward FLOPs, and parameter, gradient + optimizer, saved-activation
        and output bytes."""
        return [{"name": name, "forward_gflops": work.forward_flops / GIGA, "param_bytes": work.params * FLOAT_BYTES,
                 "optimizer_bytes": work.params * FLOAT_BYTES * optimizer_state_factor,
                 "gradient_bytes": work.params * FLOAT_BYTES,
                 "activation_bytes": work.saved_elements * precision.activation_bytes,
                 "output_bytes": work.output_bytes(precision)}
                for name, work in zip(self.block_names(), self.work(), strict=True)]


BUILT_IN_MODELS: dict[str, ModelSpec] = {
    "vit-b16": ModelSpec("vit-b16", 12, 768, 12, 3072, _vit_seq_len(VIT_IMAGE_SIZE, VIT_PATCH_SIZE),
                         VIT_PATCH_SIZE**2 * RGB_CHANNELS, IMAGENET_CLASSES, is_text=False),
    "vit-l16": ModelSpec("vit-l16", 24, 1024, 16, 4096, _vit_seq_len(VIT_IMAGE_SIZE, VIT_PATCH_SIZE),
                         VIT_PATCH_SIZE**2 * RGB_CHANNELS, IMAGENET_CLASSES, is_text=False),
    "bert-base": ModelSpec("bert-base", 12, 768, 12, 3072, BERT_BASE_SEQ_LEN, BERT_VOCAB, DEFAULT_TEXT_OUTPUTS,
                           is_text=True),
    "bert-large": ModelSpec("bert-large", 24, 1024, 16, 4096, BERT_SQUAD_SEQ_LEN, BERT_VOCAB, SPAN_OUTPUTS,
                            is_text=True),
    "minilm": ModelSpec("minilm", 6, 384, 12, 1536, MINILM_SEQ_LEN, BERT_VOCAB, DEFAULT_TEXT_OUTPUTS, is_text=True),
}
"""ViT-B/16 and ViT-L/16 at 224x224 (196 patches + class token, Dosovitskiy et al., 2021), BERT-base and
BERT-large (Devlin et al., 2019; BERT-large at SQuAD's 384 tokens with a span head), all-MiniLM-L6-v2."""


def _config_int(config: Mapping[str, Any], key: str, source: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None:
        raise ModelSpecError(f"{source}: missing {key!r}: a BERT- or ViT-style encoder config has it")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelSpecError(f"{source}: {key} must be an integer, got {value!r}")
    return value


def model_from_hf_config(config: Mapping[str, Any], *, name: str = "hf", seq_len: int | None = None,
                         num_outputs: int | None = None) -> ModelSpec:
    """A spec from a Hugging Face config dict: a ViT (``image_size``, ``patch_size``) or a text encoder
    (``vocab_size``; ``seq_len`` defaults to :data:`DEFAULT_TEXT_SEQ_LEN` or ``max_position_embeddings`` if
    fewer, and may not exceed it)."""
    if not isinstance(config, Mapping):
        raise ModelSpecError(f"{name}: expected a JSON object (a Hugging Face config), got {type(config).__name__}")
    hidden = _config_int(config, "hidden_size", name)
    layers = _config_int(config, "num_hidden_layers", name)
    heads = _config_int(config, "num_attention_heads", name)
    intermediate = _config_int(config, "intermediate_size", name, default=4 * hidden)
    if "image_size" in config or config.get("model_type") == "vit":
        image = _config_int(config, "image_size", name)
        patch = _config_int(config, "patch_size", name)
        channels = _config_int(config, "num_channels", name, default=RGB_CHANNELS)
        if image % patch:
            raise ModelSpecError(f"{name}: image_size={image} is not a multiple of patch_size={patch}")
        tokens = _vit_seq_len(image, patch)
        if seq_len is not None and seq_len != tokens:
            raise ModelSpecError(f"{name}: a ViT's sequence is fixed by image_size/patch_size ({tokens} tokens), "
                                 f"got seq_len={seq_len}: drop it")
        return ModelSpec(name, layers, hidden, heads, intermediate, tokens, patch * patch * channels,
                         num_outputs or IMAGENET_CLASSES, is_text=False)
    vocab = _config_int(config, "vocab_size", name)
    positions = config.get("max_position_embeddings")
    limit = positions if isinstance(positions, int) and positions > 0 else DEFAULT_TEXT_SEQ_LEN
    tokens = seq_len or min(DEFAULT_TEXT_SEQ_LEN, limit)
    if isinstance(positions, int) and tokens > positions:
        raise ModelSpecError(f"{name}: seq_len={tokens} exceeds max_position_embeddings={positions}: use at most that")
    return ModelSpec(name, layers, hidden, heads, intermediate, tokens, vocab, num_outputs or DEFAULT_TEXT_OUTPUTS,
                     is_text=True)


def load_model_spec(spec: str, *, seq_len: int | None = None, num_outputs: int | None = None) -> ModelSpec:
    """A built-in name (:data:`BUILT_IN_MODELS`), or a Hugging Face ``config.json`` (or its directory)."""
    if spec in BUILT_IN_MODELS:
        model = BUILT_IN_MODELS[spec]
        if seq_len is not None and seq_len != model.seq_len:
            if not model.is_text:
                raise ModelSpecError(f"--model {spec}: a ViT's sequence is fixed ({model.seq_len} tokens): "
                                     "drop --seq-len")
            model = model.with_seq_len(seq_len)
        return model if num_outputs is None else replace(model, num_outputs=num_outputs)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    config = read_json_file(path, ModelSpecError, f"--model {spec}: neither a built-in model "
                            f"({', '.join(BUILT_IN_MODELS)}) nor a Hugging Face config.json or its directory")
    return model_from_hf_config(config, name=str(path), seq_len=seq_len, num_outputs=num_outputs)
