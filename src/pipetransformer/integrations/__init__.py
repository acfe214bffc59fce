"""AutoFreeze where people already train: a plain PyTorch loop (:class:`AutoFreezer`, DDP included) and the Hugging
Face ``Trainer`` (:class:`AutoFreezeCallback`, imported on first use, as it needs ``transformers``' Trainer)."""

from __future__ import annotations

from typing import Any

from pipetransformer.integrations.ddp import drop_frozen_from_ddp
from pipetransformer.integrations.freezer import AutoFreezer
from pipetransformer.integrations.layers import LayerStack, find_layer_stack

__all__ = ["AutoFreezeCallback", "AutoFreezer", "LayerStack", "drop_frozen_from_ddp", "find_layer_stack"]


def __getattr__(name: str) -> Any:
    if name == "AutoFreezeCallback":
        from pipetransformer.integrations.hf_trainer import AutoFreezeCallback

        return AutoFreezeCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
