"""Optimizer construction and the learning-rate schedule."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipetransformer.config import TrainConfig
from pipetransformer.optim import build_optimizer, layer_lr_scales, lr_at, set_lr

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


def test_layer_lr_scales_give_the_head_the_full_rate_and_decay_downwards() -> None:
    assert layer_lr_scales(4, 0.5) == [0.125, 0.25, 0.5, 1.0]
    assert layer_lr_scales(3, 1.0) == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_set_lr_applies_each_parameters_scale(optimizer: str) -> None:
    """Every parameter steps at its own block's rate, whatever group order the parameters come in."""
    blocks = [torch.nn.Linear(3, 3) for _ in range(3)]
    scales = layer_lr_scales(len(blocks), 0.5)
    params = [p for block in reversed(blocks) for p in block.parameters()]
    config = _config(optimizer=optimizer, weight_decay=0.0, momentum=0.0)
    per_param = {p: scales[i] for i, block in enumerate(blocks) for p in block.parameters()}
    built = build_optimizer(params, config, per_param)
    set_lr(built, BASE_LR)
    before = [[p.detach().clone() for p in block.parameters()] for block in blocks]
    for p in params:
        p.grad = torch.ones_like(p)
    built.step()
    for block, start, scale in zip(blocks, before, scales, strict=True):
        for p, p0 in zip(block.parameters(), start, strict=True):
            # SGD moves lr * grad; AdamW's first step moves lr * m / (sqrt(v) + eps) = lr (to eps) for grad 1.
            torch.testing.assert_close(p0 - p.detach(), torch.full_like(p0, BASE_LR * scale), rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("schedule", ["linear", "cosine", "constant"])
def test_schedule_in_samples_equals_the_step_schedule_for_equal_batches(schedule: str) -> None:
    """The trainer counts the schedule in samples (the batch may grow with the width); with a fixed batch it is
    the step schedule."""
    config, batch = _config(lr_schedule=schedule), 32
    for step in range(TOTAL_STEPS):
        assert lr_at(step * batch, TOTAL_STEPS * batch, config, batch) == pytest.approx(lr_at(step, TOTAL_STEPS, config))
