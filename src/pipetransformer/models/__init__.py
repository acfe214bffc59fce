"""Model adapters: every supported model becomes a ``BlockSequence`` through ``build_model``."""

from __future__ import annotations

from typing import Any

from pipetransformer.models.blocks import BlockSequence, BlockSplitError
from pipetransformer.models.decoder import build_decoder, load_decoder_weights
from pipetransformer.models.hf import blocks_from_hf, load_hf_encoder, load_tokenizer, minilm_path
from pipetransformer.models.hf_decoder import blocks_from_hf_decoder, load_hf_decoder
from pipetransformer.models.vit import build_vit, load_vit_backbone

__all__ = ["MODEL_KINDS", "BlockSequence", "BlockSplitError", "build_model", "load_tokenizer", "minilm_path"]

MODEL_KINDS = ("minilm", "hf", "vit", "decoder", "hf_decoder")


def build_model(
    kind: str,
    *,
    num_labels: int,
    path: str | None = None,
    hf_config: dict[str, Any] | None = None,
    pooling: str = "mean",
    vit: dict[str, Any] | None = None,
    decoder: dict[str, Any] | None = None,
    attn_implementation: str = "sdpa",
) -> BlockSequence:
    """The one entry point the trainer calls.

    ``"minilm"``: the packaged pretrained all-MiniLM-L6-v2; ``"hf"``: pretrained weights from the local
    directory ``path``, or random weights from ``hf_config`` (a dict with ``model_type``); ``"vit"``:
    the built-in ViT with ``vit`` holding ``build_vit``'s keyword arguments except ``num_classes``, and
    ``path`` an optional backbone file from ``pipetransformer pretrain`` (the head stays freshly initialised);
    ``"decoder"``: the built-in causal decoder, ``decoder`` holding ``build_decoder``'s keyword arguments but
    ``vocab_size``, which is ``num_labels`` (the head predicts a token), and ``path`` optionally an earlier decoder
    run's ``model.safetensors`` to fine-tune (every block, head included: the byte vocabulary is shared);
    ``"hf_decoder"``: a Hugging Face causal language model from the local directory ``path``, whose ``vocab_size`` must
    be ``num_labels`` (the data's vocabulary is the model's).
    """
    if kind not in MODEL_KINDS:
        raise ValueError(f"unknown model kind {kind!r}: use one of {', '.join(MODEL_KINDS)}")
    if kind == "vit":
        if hf_config is not None:
            raise ValueError("model kind 'vit' takes no hf_config: use kind 'hf' for Hugging Face models")
        if vit is None:
            raise ValueError("model kind 'vit' needs vit settings (image_size, patch_size, in_channels, dim, ...)")
        if "num_classes" in vit:
            raise ValueError("do not set num_classes in the vit settings: it comes from num_labels")
        model = build_vit(**vit, num_classes=num_labels)
        if path is not None:
            load_vit_backbone(model, path)
        return model
    if kind == "decoder":
        if hf_config is not None or vit is not None:
            raise ValueError("model kind 'decoder' takes decoder settings and a path only (no hf_config or vit)")
        settings = dict(decoder or {})
        if "vocab_size" in settings:
            raise ValueError("do not set vocab_size in the decoder settings: it comes from the data's vocabulary")
        model = build_decoder(**settings, vocab_size=num_labels)
        if path is not None:
            load_decoder_weights(model, path)
        return model
    if kind == "hf_decoder":
        if path is None or hf_config is not None or vit is not None or decoder is not None:
            raise ValueError("model kind 'hf_decoder' takes a path only (a local directory with a causal language "
                             "model)")
        model = blocks_from_hf_decoder(load_hf_decoder(path, attn_implementation))
        rows = model.blocks[-1].projection.out_features
        if rows != num_labels:
            raise ValueError(f"the decoder at {path} predicts {rows} tokens but the data's vocabulary has "
                             f"{num_labels}: use the tokenizer saved with the model")
        return model
    if decoder is not None:
        raise ValueError(f"decoder settings apply only to model kind 'decoder', not {kind!r}: remove them")
    if vit is not None:
        raise ValueError(f"vit settings apply only to model kind 'vit', not {kind!r}: remove them")
    if kind == "minilm":
        if path is not None or hf_config is not None:
            raise ValueError("model kind 'minilm' takes no path or hf_config: use kind 'hf' for other weights")
        path = minilm_path()
    encoder = load_hf_encoder(path=path, config=hf_config, attn_implementation=attn_implementation)
    return blocks_from_hf(encoder, num_labels, pooling=pooling)
