"""Optimizer construction and the learning-rate schedule."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipetransformer.config import TrainConfig
from pipetransformer.optim import build_optimizer, lr_at

TOTAL_STEPS = 100
BASE_LR = 1e-3


def _config(**changes: object) -> TrainConfig:
    return dataclasses.replace(TrainConfig(), lr=BASE_LR, warmup_fraction=0.1, **changes)


def test_adamw_uses_the_fused_kernel_on_cpu_and_matches_the_loop() -> None:
    torch.manual_seed(0)
    weights = torch.randn(4, 3)
    fused_param, loop_param = torch.nn.Parameter(weights.clone()), torch.nn.Parameter(weights.clone())
    fused = build_optimizer([fused_param], _config())
    assert fused.defaults["fused"] is True
    loop = torch.optim.AdamW([loop_param], lr=BASE_LR, weight_decay=_config().weight_decay, foreach=False)
    for _ in range(3):
        grad = torch.randn(4, 3)
        fused_param.grad, loop_param.grad = grad.clone(), grad.clone()
        fused.step()
        loop.step()
    torch.testing.assert_close(fused_param, loop_param)


def test_sgd_is_built_when_asked() -> None:
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(2))], _config(optimizer="sgd"))
    assert isinstance(optimizer, torch.optim.SGD)


@pytest.mark.parametrize("schedule", ["linear", "cosine", "constant"])
def test_schedule_warms_up_then_decays(schedule: str) -> None:
    config = _config(lr_schedule=schedule)
    lrs = [lr_at(step, TOTAL_STEPS, config) for step in range(TOTAL_STEPS)]
    warmup = int(config.warmup_fraction * TOTAL_STEPS)
    assert lrs[0] == pytest.approx(BASE_LR / warmup)
    assert lrs[warmup - 1] == pytest.approx(BASE_LR)
    assert all(a <= b for a, b in zip(lrs[:warmup], lrs[1:warmup], strict=False))
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1:], strict=False))
    if schedule == "constant":
        assert lrs[-1] == pytest.approx(BASE_LR)
    else:
        assert lrs[-1] < 0.05 * BASE_LR
