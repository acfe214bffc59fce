"""HeldOptimizer: rebuilt over other blocks, every parameter keeps its state; state by name, in and out."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pipetransformer.config import TrainConfig
from pipetransformer.freeze.apply import freeze_blocks
from pipetransformer.models.blocks import BlockSequence
from pipetransformer.train.optimizer import HeldOptimizer
from tiny import LAYERS, tiny_dataset, tiny_model

ALL_BLOCKS = (0, LAYERS + 2)
SETTINGS = dataclasses.replace(TrainConfig(), lr=1e-2, layer_lr_decay=0.5, grad_clip=None)


def _train(model: BlockSequence, optimizer: HeldOptimizer, steps: int) -> None:
    batch = tiny_dataset().get_batch(list(range(8)))
    for _ in range(steps):
        nn.functional.cross_entropy(model(*batch.inputs), batch.labels).backward()
        optimizer.step(SETTINGS.lr, total_grad_norm=0.0)


def test_a_rebuild_keeps_the_state_of_held_parameters_and_each_blocks_rate() -> None:
    model = tiny_model()
    optimizer = HeldOptimizer(model, SETTINGS)
    optimizer.rebuild(ALL_BLOCKS, {})
    _train(model, optimizer, 2)
    head = next(model.blocks[-1].parameters())
    before = {k: v.clone() for k, v in optimizer.state[head].items()}
    freeze_blocks(model, {0, 1}, optimizer.optimizer)
    optimizer.rebuild((1, LAYERS + 2), {})  # another stage's range: block 0 left, block 1 frozen
    held_blocks = range(2, LAYERS + 2)  # layers 1.. and the head
    assert optimizer.params == [p for i in held_blocks for p in model.blocks[i].parameters()]
    assert all(torch.equal(optimizer.state[head][k], v) for k, v in before.items())
    assert optimizer.optimizer is not None
    rates = {group["lr_scale"] for group in optimizer.optimizer.param_groups}
    assert rates == {0.5 ** (LAYERS + 1 - i) for i in held_blocks}, "each block keeps its layer-wise rate"


def test_state_by_name_round_trips_and_waits_for_the_build() -> None:
    model = tiny_model()
    optimizer = HeldOptimizer(model, SETTINGS)
    optimizer.rebuild(ALL_BLOCKS, {})
    _train(model, optimizer, 3)
    saved = optimizer.state_dict()
    assert "blocks.0.1.weight.exp_avg" in saved and "blocks.4.bias.step" in saved
    restored_model = tiny_model()
    restored = HeldOptimizer(restored_model, SETTINGS)
    restored.load_state_dict(saved)  # before any layout: installed at the first build
    restored.rebuild(ALL_BLOCKS, {})
    assert restored.state_dict().keys() == saved.keys()
    assert all(torch.equal(restored.state_dict()[name], tensor) for name, tensor in saved.items())


def test_received_state_wins_and_nothing_is_held_without_trainable_blocks() -> None:
    model = tiny_model()
    optimizer = HeldOptimizer(model, SETTINGS)
    head_weight = model.blocks[-1].weight
    arrived = {"step": torch.tensor(5.0), "exp_avg": torch.ones_like(head_weight),
               "exp_avg_sq": torch.ones_like(head_weight)}
    optimizer.rebuild(ALL_BLOCKS, {head_weight: arrived})
    assert optimizer.state[head_weight] is arrived
    freeze_blocks(model, {0, 1}, optimizer.optimizer)
    optimizer.rebuild((0, 2), {})
    assert optimizer.optimizer is None and optimizer.params == [] and dict(optimizer.state) == {}
    optimizer.step(SETTINGS.lr, total_grad_norm=1.0)  # nothing to update: a no-op


def test_the_step_clips_by_the_whole_models_norm() -> None:
    clipped = dataclasses.replace(SETTINGS, grad_clip=0.5, optimizer="sgd", momentum=0.0, weight_decay=0.0)
    model, reference = tiny_model(), tiny_model()
    optimizer = HeldOptimizer(model, clipped)
    optimizer.rebuild(ALL_BLOCKS, {})
    for each in (model, reference):
        each.blocks[-1].weight.grad = torch.full_like(each.blocks[-1].weight, 2.0)
    total = float(model.blocks[-1].weight.grad.norm())
    optimizer.step(lr=1.0, total_grad_norm=total)
    torch.nn.utils.clip_grad_norm_([reference.blocks[-1].weight], 0.5)
    initial = tiny_model().blocks[-1].weight  # SGD at rate 1 (the head's scale is 1), no momentum or decay
    torch.testing.assert_close(model.blocks[-1].weight, initial - reference.blocks[-1].weight.grad)
    assert model.blocks[-1].weight.grad is None, "gradients are cleared after the step"
