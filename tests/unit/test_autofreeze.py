"""AutoFreeze on its own: observe the control vector, decide at the policy's step, apply to model and optimizer,
record; its state re-freezes a fresh model."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from pipetransformer.config import ConfigError, load_config
from pipetransformer.freeze.policies import make_policy
from pipetransformer.train.autofreeze import AutoFreeze
from pipetransformer.train.control import ControlVector
from pipetransformer.train.optimizer import HeldOptimizer
from tiny import LAYERS, tiny_model

FREEZE_TWO_AT_STEP_TWO = [[2, 2]]
ROOT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_text.yaml"


def _freezer(model: torch.nn.Module) -> AutoFreeze:
    policy = make_policy("schedule", LAYERS, interval=1, interval_unit="steps", alpha=0.5, percentile=50.0,
                         max_fraction=1.0, schedule=FREEZE_TWO_AT_STEP_TWO, seed=0)
    return AutoFreeze(policy, model, gradient_dots=False)  # type: ignore[arg-type]


def test_a_decision_freezes_the_leading_blocks_drops_them_from_the_optimizer_and_is_recorded() -> None:
    model = tiny_model()
    optimizer = HeldOptimizer(model, load_config(None).train)
    optimizer.rebuild((0, len(model)), {})
    freezer = _freezer(model)
    control = ControlVector.zeros(LAYERS)
    control.layer_grad_sq[:] = torch.tensor([4.0, 1.0, 9.0], dtype=torch.float64)
    assert freezer.observe(control) == ([2.0, 1.0, 3.0], None, None)
    assert freezer.update(1, 0, epoch_end=False, optimizer=optimizer) is None
    record = freezer.update(2, 0, epoch_end=False, optimizer=optimizer)
    assert record is not None and (record["step"], record["epoch"], record["frozen"]) == (2, 0, [0, 1])
    assert (freezer.prefix_layers(), freezer.prefix_blocks()) == (2, 3)
    frozen = [p for i in range(3) for p in model.blocks[i].parameters()]
    assert not any(p.requires_grad for p in frozen) and not model.blocks[1].training
    assert optimizer.optimizer is not None
    held = {id(p) for group in optimizer.optimizer.param_groups for p in group["params"]}
    assert not held & {id(p) for p in frozen}


def test_its_state_refreezes_a_fresh_model() -> None:
    model = tiny_model()
    freezer = _freezer(model)
    freezer.update(1, 0, epoch_end=False, optimizer=HeldOptimizer(model, load_config(None).train))
    freezer.update(2, 0, epoch_end=False, optimizer=HeldOptimizer(model, load_config(None).train))
    fresh = _freezer(tiny_model())
    fresh.load_state_dict(freezer.state_dict())
    assert fresh.frozen == frozenset({0, 1})
    assert [p.requires_grad for p in fresh.model.parameters()] == [p.requires_grad for p in model.parameters()]


def test_from_config_keeps_each_policys_signal_and_warns_when_nothing_can_freeze(
        caplog: pytest.LogCaptureFixture) -> None:
    config = load_config(ROOT_CONFIG, ["freeze.enabled=true", "freeze.interval=50", "freeze.interval_unit=steps",
                                       "run.log_every=10"])
    with caplog.at_level(logging.WARNING):
        freezer = AutoFreeze.from_config(config, tiny_model(), planned_steps=100, steps_per_epoch=50, warn=True)
    assert freezer.previous_weights is not None, "descent (the default) reads -g_t . (w_t - w_(t-1))"
    assert freezer.previous_grads is None, "and nothing else, unless every step is logged"
    coherence = load_config(ROOT_CONFIG, ["freeze.enabled=true", "freeze.policy=coherence", "run.log_every=10"])
    freezer = AutoFreeze.from_config(coherence, tiny_model(), planned_steps=100, steps_per_epoch=50, warn=False)
    assert freezer.previous_grads is not None and freezer.previous_weights is None, "coherence reads g_t . g_(t-1)"
    every_step = load_config(ROOT_CONFIG, ["freeze.enabled=true", "freeze.policy=geometric", "run.log_every=1"])
    freezer = AutoFreeze.from_config(every_step, tiny_model(), planned_steps=100, steps_per_epoch=50, warn=False)
    assert freezer.previous_grads is not None and freezer.previous_weights is not None, "both logged for replay"
    assert any("nothing will freeze" in r.getMessage() and "shorten freeze.interval" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    floored = load_config(ROOT_CONFIG, ["freeze.enabled=true", "freeze.interval_unit=fraction"])
    with caplog.at_level(logging.WARNING):  # 5% of 20 steps is 1, raised to the 10-step floor: 4 windows need 40
        AutoFreeze.from_config(floored, tiny_model(), planned_steps=20, steps_per_epoch=20, warn=True)
    assert any("nothing will freeze" in r.getMessage() and "freeze.min_window_steps" in r.getMessage()
               for r in caplog.records), "a fraction window is held at its floor: that is the setting to change"
    caplog.clear()
    wide = load_config(ROOT_CONFIG, ["freeze.enabled=true", "freeze.interval_unit=fraction", "freeze.interval=0.5"])
    with caplog.at_level(logging.WARNING):  # half of 200 steps a window: 3 windows need 300
        AutoFreeze.from_config(wide, tiny_model(), planned_steps=200, steps_per_epoch=200, warn=True)
    assert any("nothing will freeze" in r.getMessage() and r.getMessage().endswith("shorten freeze.interval")
               for r in caplog.records)
    caplog.clear()
    lasting = ["freeze.enabled=true", "freeze.policy=coherence", "freeze.interval=10", "freeze.interval_unit=steps",
               "freeze.learned_min_steps=1"]
    with caplog.at_level(logging.WARNING):  # 3 windows of 10 fit 35 steps; 20 steps of learning make it 4 windows
        AutoFreeze.from_config(load_config(ROOT_CONFIG, lasting), tiny_model(), planned_steps=35, steps_per_epoch=35,
                               warn=True)
        assert not caplog.records
        AutoFreeze.from_config(load_config(ROOT_CONFIG, lasting[:-1]), tiny_model(), planned_steps=35,
                               steps_per_epoch=35, warn=True)  # the default, 20
    assert any("the first decision needs 40 steps but the run has 35" in r.getMessage() for r in caplog.records)
    geometric = load_config(ROOT_CONFIG, ["freeze.enabled=true", "freeze.policy=geometric", "run.log_every=10"])
    assert AutoFreeze.from_config(geometric, tiny_model(), planned_steps=100, steps_per_epoch=50,
                                  warn=False).previous_grads is None


@pytest.mark.parametrize(("overrides", "embeddings", "layers"), [
    ([], False, 0),  # the default, none
    (["freeze.prior=auto"], False, 0),  # tiny_text: random weights (model.hf_config), so auto freezes nothing
    (["model.kind=minilm"], False, 0),  # pretrained weights: the default is still none (the evidence decides)
    (["model.kind=minilm", "freeze.prior=auto"], True, 1),  # auto: the embeddings and a third of the 3 layers
    (["freeze.prior=embeddings"], True, 0),
    (["freeze.prior=2"], True, 2),
    (["model.kind=minilm", "freeze.prior=none"], False, 0),
    (["model.kind=minilm", "freeze.enabled=false"], False, 0),  # no AutoFreeze, no prior
])
def test_the_prior_freezes_what_its_setting_says_before_the_optimizer_is_built(
        overrides: list[str], embeddings: bool, layers: int) -> None:
    config = load_config(ROOT_CONFIG, ["freeze.enabled=true", *overrides])
    model = tiny_model()
    freezer = AutoFreeze.from_config(config, model, planned_steps=100, steps_per_epoch=50, warn=False)
    frozen_blocks = layers + 1 if embeddings else 0
    assert (freezer.prior.embeddings, freezer.prior.layers) == (embeddings, layers)
    assert freezer.frozen == frozenset(range(layers))
    assert freezer.prefix_blocks() == frozen_blocks
    assert [all(not p.requires_grad for p in block.parameters()) for block in model.blocks] == \
        [i < frozen_blocks for i in range(len(model.blocks))]
    optimizer = HeldOptimizer(model, config.train)
    optimizer.rebuild((0, len(model)), {})
    assert optimizer.optimizer is not None
    held = {id(p) for group in optimizer.optimizer.param_groups for p in group["params"]}
    assert not held & {id(p) for i in range(frozen_blocks) for p in model.blocks[i].parameters()}
    described = freezer.prior.describe()
    assert ("frozen from the first step" in described) == embeddings
    assert ("freeze.prior" if config.freeze.enabled else "freeze.enabled: false") in described
    assert freezer.summary(log=False)["freeze_prior_layers"] == layers  # summary.json's count, for scripts
    # a resumed run re-applies the prior to a fresh model and keeps the policy's layers
    fresh = AutoFreeze.from_config(config, tiny_model(), planned_steps=100, steps_per_epoch=50, warn=False)
    fresh.load_state_dict(freezer.state_dict())
    assert [p.requires_grad for p in fresh.model.parameters()] == [p.requires_grad for p in model.parameters()]


def test_a_schedule_entry_at_zero_freezes_before_the_optimizer_is_built_and_is_recorded_at_step_zero() -> None:
    config = load_config(ROOT_CONFIG, ["freeze.enabled=true", "freeze.policy=schedule", "freeze.interval_unit=steps",
                                       "freeze.schedule=[[0,2]]", "freeze.prior=embeddings"])
    model = tiny_model()
    freezer = AutoFreeze.from_config(config, model, planned_steps=100, steps_per_epoch=50, warn=False)
    assert freezer.start_record() == {"step": 0, "epoch": 0, "frozen": [0, 1], "at": 0, "scheduled": 2}
    assert [all(not p.requires_grad for p in block.parameters()) for block in model.blocks] == \
        [i < 3 for i in range(len(model.blocks))]
    optimizer = HeldOptimizer(model, config.train)
    optimizer.rebuild((0, len(model)), {})
    assert freezer.update(1, 0, epoch_end=False, optimizer=optimizer) is None, "nothing left to freeze at step 1"
    assert AutoFreeze.from_config(load_config(ROOT_CONFIG, ["freeze.enabled=true"]), tiny_model(), planned_steps=100,
                                  steps_per_epoch=50, warn=False).start_record() is None


def test_a_prior_that_leaves_no_layer_training_is_refused() -> None:
    config = load_config(ROOT_CONFIG, ["freeze.enabled=true", f"freeze.prior={LAYERS}"])
    with pytest.raises(ConfigError, match="freeze.prior must be auto, none, embeddings or a layer count in 0..2"):
        AutoFreeze.from_config(config, tiny_model(), planned_steps=100, steps_per_epoch=50, warn=False)
