"""The config of an exported PipeTransformer text classifier: the encoder's own config, nested, and the pooling.

Shipped inside the exported directory by ``pipetransformer export``; imports ``transformers`` only."""

from __future__ import annotations

from typing import Any

try:  # transformers 5
    from transformers import PreTrainedConfig
except ImportError:  # transformers 4
    from transformers import PretrainedConfig as PreTrainedConfig

POOLINGS = ("mean", "cls")


class PipeTransformerTextConfig(PreTrainedConfig):
    """``encoder``: the encoder's config as a dict (its ``model_type`` included); ``pooling``: ``mean`` over the real
    tokens, or ``cls`` (the first token)."""

    model_type = "pipetransformer_text"

    def __init__(self, encoder: dict[str, Any] | None = None, pooling: str = "mean", **kwargs: Any) -> None:
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        self.encoder = dict(encoder or {})
        self.pooling = pooling
        super().__init__(**kwargs)
