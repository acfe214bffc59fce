"""A model's ordered layers and what freezes with them, found by structure in Hugging Face encoders and decoders.

The layer list is looked up at the attribute paths ``models/hf.py`` splits encoders by (BERT-like
``encoder.layer``, Llama-style ``layers``) plus GPT-2's ``h``, under the model's ``base_model`` (so a
``...ForSequenceClassification`` or ``...ForCausalLM`` is searched where its trunk is), inside a PEFT wrapper
(LoRA and the like: its ``get_base_model()``) when there is one. The embeddings freeze
with layer 0 (or alone, by the freeze prior), as in the trainer, except a parameter the rest of the model also
uses (a tied token table is the LM head's weight, as in GPT-2): that one keeps training.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from pipetransformer.models.blocks import BlockSplitError
from pipetransformer.models.hf import EMBEDDING_PROJECTION_PATHS, EMBEDDINGS_PATH, LAYER_LIST_PATHS, REFUSED_MODEL_TYPES

__all__ = ["DECODER_EMBEDDING_PATHS", "DECODER_LAYER_LIST_PATHS", "LayerStack", "find_layer_stack", "model_trunk"]

DECODER_LAYER_LIST_PATHS = ("h", "decoder.layers")
"""GPT-2 / GPT-J / BLOOM-style (``h``) and OPT-style (``decoder.layers``); Llama-style ``layers`` is already an
encoder path."""
DECODER_EMBEDDING_PATHS = ("wte", "wpe", "embed_tokens", "embed_positions", "decoder.embed_tokens",
                           "decoder.embed_positions", "word_embeddings")
"""Token and position tables of decoders, which keep them beside the layers rather than in one module."""


@dataclass(frozen=True)
class LayerStack:
    """The ordered layers of a model and the modules that freeze with layer 0 (the embeddings)."""

    layers: tuple[nn.Module, ...]
    embeddings: tuple[nn.Module, ...] = ()
    model: nn.Module | None = None  # the whole model, to tell which embedding parameters are used elsewhere

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("AutoFreezer needs at least one layer; pass the model's ordered layers")
        owner: dict[int, int] = {}
        for index, layer in enumerate(self.layers):
            for parameter in layer.parameters():
                first = owner.setdefault(id(parameter), index)
                if first != index:
                    raise ValueError(f"layers {first} and {index} share a parameter, so they cannot freeze one by "
                                     "one; pass layers that own their weights")

    @property
    def blocks(self) -> Sequence[nn.Module]:
        """The layers (what the gradient statistics of ``freeze.apply`` read, one value per layer)."""
        return self.layers

    def __len__(self) -> int:
        return len(self.layers)

    def shared_embedding_parameters(self) -> set[int]:
        """Ids of embedding parameters some module outside the embeddings and layers also holds (a tied LM head)."""
        if self.model is None:
            return set()
        inside = {id(m) for part in (*self.embeddings, *self.layers) for m in part.modules()}
        elsewhere = {id(p) for m in self.model.modules() if id(m) not in inside
                     for p in m.parameters(recurse=False)}
        return {id(p) for e in self.embeddings for p in e.parameters()} & elsewhere

    def prefix(self, frozen_layers: int, embeddings: bool = False) -> tuple[list[nn.Parameter], list[nn.Module]]:
        """The parameters that freeze with the first ``frozen_layers`` layers (and the embeddings, which also freeze
        alone with ``embeddings``: a prior), and the modules that become wholly frozen (eval mode, no autograd)."""
        if frozen_layers == 0 and not embeddings:
            return [], []
        shared = self.shared_embedding_parameters()
        modules = [e for e in self.embeddings if not any(id(p) in shared for p in e.parameters())]
        modules += list(self.layers[:frozen_layers])
        parameters = [p for e in self.embeddings for p in e.parameters() if id(p) not in shared]
        parameters += [p for layer in self.layers[:frozen_layers] for p in layer.parameters()]
        return list({id(p): p for p in parameters}.values()), modules


def _lookup(module: nn.Module, dotted_path: str) -> object | None:
    found: object = module
    for part in dotted_path.split("."):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


def model_trunk(model: nn.Module) -> nn.Module:
    """Where a Hugging Face model keeps its embeddings and layers: its ``base_model`` (the trunk under a task head),
    inside a PEFT wrapper's ``get_base_model()`` when there is one."""
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    base = getattr(inner, "base_model", inner)
    return base if isinstance(base, nn.Module) else inner


def find_layer_stack(model: nn.Module) -> LayerStack:
    """The layers and embeddings of a Hugging Face encoder or decoder (with or without a task head); a one-line
    error naming the model when none are found."""
    name = type(model).__name__
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in REFUSED_MODEL_TYPES:
        raise BlockSplitError(f"cannot freeze {name} layer by layer: {REFUSED_MODEL_TYPES[model_type]}")
    trunk = model_trunk(model)
    layers = next((found for found in (_lookup(trunk, path) for path in LAYER_LIST_PATHS + DECODER_LAYER_LIST_PATHS)
                   if isinstance(found, nn.ModuleList) and len(found) > 0), None)
    if layers is None:
        paths = ", ".join(LAYER_LIST_PATHS + DECODER_LAYER_LIST_PATHS)
        raise BlockSplitError(f"cannot find the layers of {name}: no non-empty nn.ModuleList at any of {paths}; pass "
                              "its ordered layers instead: AutoFreezer(LayerStack(layers, embeddings, model), "
                              "optimizer)")
    embedding_paths = (EMBEDDINGS_PATH, *EMBEDDING_PROJECTION_PATHS, *DECODER_EMBEDDING_PATHS)
    embeddings = [found for found in (_lookup(trunk, path) for path in embedding_paths) if isinstance(found, nn.Module)]
    return LayerStack(tuple(layers), tuple({id(e): e for e in embeddings}.values()), model)
