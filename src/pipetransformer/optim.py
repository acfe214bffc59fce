"""Optimizer and learning-rate schedule.

The schedule is a pure function of the global step, so it needs no state of its own to hand over to a
new replica or to a checkpoint: the step is the state.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from .config import TrainConfig

__all__ = ["build_optimizer", "lr_at", "set_lr"]


def lr_at(step: int, total_steps: int, config: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warm-up, then the chosen decay."""
    warmup = int(config.warmup_fraction * total_steps)
    if step < warmup:
        return config.lr * (step + 1) / warmup
    if config.lr_schedule == "constant":
        return config.lr
    span = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    if config.lr_schedule == "linear":
        return config.lr * (1.0 - progress)
    return config.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


FUSED_ADAMW_DEVICES = ("cpu", "cuda")
"""Where torch has a fused AdamW kernel. On CPU torch's default is a per-tensor loop: for MiniLM-L6 one step
took 91 ms on one thread against 12 ms fused (benchmarks/optimizer)."""


def build_optimizer(params: Iterable[torch.nn.Parameter], config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW (fused where torch has the kernel) or SGD over ``params``."""
    params = list(params)
    if config.optimizer == "adamw":
        fused = all(p.device.type in FUSED_ADAMW_DEVICES for p in params)
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, fused=fused or None)
    return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
