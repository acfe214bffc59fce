"""Freezing blocks of a live model: parameters stop moving, the optimizer forgets exactly them, eval mode sticks."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable

import pytest
import torch
from torch import nn

from pipetransformer.freeze.apply import (DESCENT_SAMPLE_STRIDE, PreviousGradients, PreviousWeights, block_grad_sq_norms,
                                          freeze_blocks, replica_share)
from pipetransformer.freeze.policies import frozen_blocks
from pipetransformer.models.blocks import BlockSequence

WIDTH = 8
INPUTS = 4
CLASSES = 3
NUM_LAYERS = 3
BATCH = 5
DROPOUT = 0.3
WEIGHT_DECAY = 0.1
LR = 1e-2
FROZEN = frozenset({0, 1})  # embeddings and layer 0


def tiny_model(seed: int = 0) -> BlockSequence:
    torch.manual_seed(seed)
    embeddings = nn.Sequential(nn.Linear(INPUTS, WIDTH), nn.Dropout(DROPOUT))
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Dropout(DROPOUT)) for _ in range(NUM_LAYERS)]
    return BlockSequence(embeddings, layers, nn.Linear(WIDTH, CLASSES), task="image")


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, INPUTS, generator=generator), torch.randint(0, CLASSES, (BATCH,), generator=generator)


def train_step(model: BlockSequence, optimizers: list[torch.optim.Optimizer], step: int) -> None:
    inputs, labels = batch(step)
    torch.manual_seed(step)  # identical dropout masks in every run
    for optimizer in optimizers:
        optimizer.zero_grad()
    nn.functional.cross_entropy(model(inputs), labels).backward()
    for optimizer in optimizers:
        optimizer.step()


def block_params(model: BlockSequence, blocks: frozenset[int]) -> list[nn.Parameter]:
    return [p for i in sorted(blocks) for p in model.blocks[i].parameters()]


def test_frozen_parameters_stay_bit_identical_under_adamw_with_weight_decay() -> None:
    model = tiny_model()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for step in range(3):
        train_step(model, [optimizer], step)
    count = freeze_blocks(model, FROZEN, optimizer)
    assert count == sum(p.numel() for p in block_params(model, FROZEN))
    snapshot = [p.detach().clone() for p in block_params(model, FROZEN)]
    active_before = [p.detach().clone() for p in model.blocks[3].parameters()]
    for step in range(3, 8):
        train_step(model, [optimizer], step)
    for frozen, before in zip(block_params(model, FROZEN), snapshot, strict=True):
        assert torch.equal(frozen, before) and frozen.grad is None and not frozen.requires_grad
    assert not all(torch.equal(p, b) for p, b in zip(model.blocks[3].parameters(), active_before, strict=True))


def test_active_parameters_match_an_optimizer_that_never_held_the_frozen_ones() -> None:
    model = tiny_model()
    reference = copy.deepcopy(model)
    model.train()
    reference.train()
    frozen_ids = {id(p) for p in block_params(reference, FROZEN)}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    # The reference trains the soon-frozen blocks with an optimizer of their own (AdamW is per parameter),
    # so before the freeze both runs follow the same trajectory.
    soon_frozen = torch.optim.AdamW(block_params(reference, FROZEN), lr=LR, weight_decay=WEIGHT_DECAY)
    rest = [p for p in reference.parameters() if id(p) not in frozen_ids]
    active = torch.optim.AdamW(rest, lr=LR, weight_decay=WEIGHT_DECAY)
    for step in range(3):
        train_step(model, [optimizer], step)
        train_step(reference, [soon_frozen, active], step)

    active_params = [p for p in model.parameters() if id(p) not in {id(q) for q in block_params(model, FROZEN)}]
    state_objects = {id(p): optimizer.state[p] for p in active_params}
    freeze_blocks(model, FROZEN, optimizer)
    for parameter in block_params(reference, FROZEN):
        parameter.requires_grad_(False)
        parameter.grad = None
    for index in FROZEN:
        reference.blocks[index].eval()

    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in active_params]
    assert set(map(id, optimizer.state)) == set(state_objects)
    assert all(optimizer.state[p] is state_objects[id(p)] for p in active_params)
    for step in range(3, 8):
        train_step(model, [optimizer], step)
        train_step(reference, [active], step)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(active_params, active.param_groups[0]["params"], strict=True):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[ours][key], active.state[theirs][key]), key


def test_emptied_param_groups_stay_so_schedulers_keep_working() -> None:
    model = tiny_model()
    model.train()
    frozen = block_params(model, FROZEN)
    rest = [p for p in model.parameters() if all(p is not q for q in frozen)]
    groups = [{"params": frozen, "lr": LR / 10}, {"params": rest}]
    optimizer = torch.optim.AdamW(groups, lr=LR, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s: 1.0, lambda s: 1.0 / (1 + s)])
    train_step(model, [optimizer], 0)
    freeze_blocks(model, FROZEN, optimizer)
    assert len(optimizer.param_groups) == 2 and optimizer.param_groups[0]["params"] == []
    for step in range(1, 4):
        train_step(model, [optimizer], step)
        scheduler.step()
    assert optimizer.param_groups[1]["lr"] == pytest.approx(LR / 4)


def test_frozen_blocks_stay_in_eval_mode_after_model_train() -> None:
    model = tiny_model()
    freeze_blocks(model, FROZEN, None)
    model.train()
    for index, block in enumerate(model.blocks):
        expected_training = index not in FROZEN
        assert all(m.training == expected_training for m in block.modules()), index
    inputs, _ = batch(0)
    assert torch.equal(model.forward_range((inputs,), 0, 2)[0], model.forward_range((inputs,), 0, 2)[0])
    assert not torch.equal(model.forward_range((inputs,), 0, 3)[0], model.forward_range((inputs,), 0, 3)[0])
    model.eval()
    model.train()
    assert not model.blocks[0][1].training and model.blocks[2].training


@pytest.mark.parametrize("clone", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))], ids=["deepcopy", "pickle"])
def test_the_eval_pin_survives_copies(clone: Callable[[BlockSequence], BlockSequence]) -> None:
    model = tiny_model()
    freeze_blocks(model, FROZEN, None)
    copied = clone(model)
    copied.train()
    assert not copied.blocks[1].training and copied.blocks[2].training
    assert copied.blocks[1].train(True) is copied.blocks[1]
    buffer = io.BytesIO()
    torch.save(copied.state_dict(), buffer)
    assert set(torch.load(io.BytesIO(buffer.getvalue())).keys()) == set(model.state_dict().keys())


def test_freezing_again_counts_nothing_and_the_head_never_freezes() -> None:
    model = tiny_model()
    assert freeze_blocks(model, frozen_blocks({0}, NUM_LAYERS), None) > 0
    assert freeze_blocks(model, {0, 1}, None) == 0
    with pytest.raises(ValueError, match="head"):
        freeze_blocks(model, {NUM_LAYERS + 1}, None)


def test_block_grad_sq_norms_sums_squares_per_layer_and_skips_frozen_or_absent() -> None:
    model = tiny_model()
    inputs, labels = batch(0)
    nn.functional.cross_entropy(model(inputs), labels).backward()
    expected = [
        sum(float((p.grad.double() ** 2).sum()) for p in model.blocks[layer + 1].parameters())
        for layer in range(NUM_LAYERS)
    ]
    norms = block_grad_sq_norms(model)[1:-1]  # the layers' blocks
    # Per-tensor norms in float32 (as clip_grad_norm_), summed in float64: float32 precision.
    assert norms.dtype == torch.float64 and norms.shape == (NUM_LAYERS,)
    assert norms.tolist() == pytest.approx(expected, rel=1e-5)
    assert all(value > 0 for value in expected)
    freeze_blocks(model, frozen_blocks({0}, NUM_LAYERS), None)
    model.blocks[3].zero_grad(set_to_none=True)
    assert block_grad_sq_norms(model)[1:-1].tolist() == pytest.approx([0.0, expected[1], 0.0], rel=1e-5)


def backward(model: BlockSequence, step: int) -> list[torch.Tensor]:
    """Fresh gradients of one batch; returns every block's flattened gradient (zeros where it has none)."""
    model.zero_grad(set_to_none=True)
    inputs, labels = batch(step)
    nn.functional.cross_entropy(model(inputs), labels).backward()
    return [torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                       for p in block.parameters()]) for block in model.blocks]


def test_previous_gradients_give_each_blocks_dot_with_the_last_step_and_forget_frozen_blocks() -> None:
    model = tiny_model()
    history = PreviousGradients()
    everything = range(len(model))
    first = backward(model, 0)
    dots, valid = history.block_dots(model, everything)
    assert torch.equal(valid, torch.zeros(len(model), dtype=torch.float64))  # no previous step yet
    second = backward(model, 1)
    dots, valid = history.block_dots(model, everything)
    assert valid.tolist() == [1.0] * len(model)
    expected = torch.stack([(a.double() * b.double()).sum() for a, b in zip(first, second)])
    assert torch.allclose(dots, expected, rtol=1e-5)
    freeze_blocks(model, {0, 1}, None)
    third = backward(model, 2)
    dots, valid = history.block_dots(model, range(1, len(model)))  # this rank now holds blocks 1.. only
    assert valid.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert torch.allclose(dots[2:], torch.stack([(a.double() * b.double()).sum()
                                                 for a, b in zip(second[2:], third[2:])]), rtol=1e-5)
    backward(model, 3)
    dots, valid = history.block_dots(model, range(3, len(model)))  # block 2 moved away, then comes back:
    backward(model, 4)
    dots, valid = history.block_dots(model, range(2, len(model)))
    assert valid.tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]  # its previous gradient is two steps old: not valid


def flat_weights(model: BlockSequence) -> list[torch.Tensor]:
    return [torch.cat([p.detach().reshape(-1).clone() for p in block.parameters()]) for block in model.blocks]


def test_previous_weights_give_each_blocks_descent_of_the_last_update_on_this_batch() -> None:
    """``-g_t . (w_t - w_{t-1})``: the previous update measured with the gradient of the batch after it, positive when
    that update lowered this batch's loss to first order; frozen or moved blocks have none."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    history = PreviousWeights(stride=1)  # every entry: the exact dot product
    everything = range(len(model))
    backward(model, 0)
    descents, valid = history.block_descents(model, everything)
    assert torch.equal(valid, torch.zeros(len(model), dtype=torch.float64))  # no previous step yet
    before = flat_weights(model)
    optimizer.step()
    gradients = backward(model, 0)  # the batch the update came from (the trainer's is the next one)
    descents, valid = history.block_descents(model, everything)
    assert valid.tolist() == [1.0] * len(model)
    update = [after - earlier for after, earlier in zip(flat_weights(model), before)]
    expected = torch.stack([-(g.double() * u.double()).sum() for g, u in zip(gradients, update)])
    assert torch.allclose(descents, expected, rtol=1e-5)
    assert float(descents.sum()) > 0, "a small SGD step lowers the loss of the batch it was computed on"
    freeze_blocks(model, {0, 1}, None)
    optimizer.step()
    backward(model, 2)
    descents, valid = history.block_descents(model, range(1, len(model)))  # this rank now holds blocks 1.. only
    assert valid.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0] and descents[:2].tolist() == [0.0, 0.0]
    backward(model, 3)
    history.block_descents(model, range(3, len(model)))  # block 2 moved away, then comes back:
    backward(model, 4)
    _, valid = history.block_descents(model, range(2, len(model)))
    assert valid.tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]  # its previous weights are two steps old: not valid


def test_the_sampled_descent_estimates_the_whole_dot_product() -> None:
    """The default reads every 32nd entry and scales up: on a layer of realistic size, with an update partly aligned
    with the next gradient, the estimate is within a few percent of the whole dot product."""
    torch.manual_seed(0)
    layer = nn.Linear(512, 512)
    model = BlockSequence(layer, [nn.Identity()], nn.Identity(), task="image")
    update, gradient = torch.randn_like(layer.weight) * 1e-3, torch.randn_like(layer.weight)
    gradient -= 50.0 * update  # the next batch's gradient opposes part of the update: a positive descent
    history = PreviousWeights()
    assert history.stride == DESCENT_SAMPLE_STRIDE
    layer.weight.grad, layer.bias.grad = torch.zeros_like(layer.weight), None
    layer.bias.requires_grad_(False)
    history.block_descents(model, range(1))
    with torch.no_grad():
        layer.weight += update
    layer.weight.grad = gradient
    descents, valid = history.block_descents(model, range(1))
    whole = -float((gradient.double() * update.double()).sum())
    assert valid[0] == 1.0 and whole > 0
    assert float(descents[0]) == pytest.approx(whole, rel=0.05)


@pytest.mark.parametrize("replicas", [1, 2, 3, 5])
def test_the_replicas_shares_cover_every_block_once(replicas: int) -> None:
    blocks = range(2, 9)
    shares = [replica_share(blocks, replicas, replica) for replica in range(replicas)]
    assert sorted(index for share in shares for index in share) == list(blocks)
    assert max(map(len, shares)) - min(map(len, shares)) <= 1  # layers cost alike: as many each, within one
    with pytest.raises(ValueError, match=f"replica {replicas} is not one of {replicas}"):
        replica_share(blocks, replicas, replicas)
