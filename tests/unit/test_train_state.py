"""TrainState and the Checkpointer on their own (one process): what a checkpoint carries comes back whole."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from pipetransformer.config import CheckpointConfig, Config, load_config
from pipetransformer.data.sampler import ElasticSampler
from pipetransformer.freeze.policies import make_policy
from pipetransformer.train.autofreeze import AutoFreeze
from pipetransformer.train.checkpointer import Checkpointer
from pipetransformer.train.optimizer import HeldOptimizer
from pipetransformer.train.state import Progress, TrainState
from tiny import LAYERS, ROWS, env, layout, tiny_dataset, tiny_model

CONFIG: Config = load_config(None)
SAMPLER_SEED = 3


def _state(seed: int) -> TrainState:
    """Every piece fresh, the model from ``seed``: what a restarted process builds before resuming."""
    model = tiny_model(seed)
    policy = make_policy("schedule", LAYERS, interval=1, interval_unit="steps", alpha=0.5, percentile=50.0,
                         max_fraction=1.0, schedule=[[2, 1]], seed=0)
    return TrainState(model=model, optimizer=HeldOptimizer(model, CONFIG.train),
                      sampler=ElasticSampler(ROWS, seed=SAMPLER_SEED),
                      freezer=AutoFreeze(policy, model, gradient_dots=False),
                      layout=layout(model, tiny_dataset(), env()), progress=Progress(), config=CONFIG)


def _adopt_first_layout(state: TrainState) -> None:
    frozen = state.freezer.prefix_blocks()
    state.layout.transition(state.layout.plan_for(frozen, 0), state.optimizer)


def _train_two_steps(state: TrainState) -> None:
    dataset = tiny_dataset()
    for step in (1, 2):
        batch = dataset.get_batch(state.sampler.next_global_batch(8))  # type: ignore[arg-type]
        nn.functional.cross_entropy(state.model(*batch.inputs), batch.labels).backward()
        state.optimizer.step(CONFIG.train.lr, total_grad_norm=0.0)
        state.progress.step, state.progress.samples = step, state.progress.samples + len(batch)
        if state.freezer.update(step, 0, epoch_end=False, optimizer=state.optimizer) is not None:
            state.layout.transition(state.layout.plan_for(state.freezer.prefix_blocks(), 0), state.optimizer)


def test_progress_round_trips_and_counts_the_restart() -> None:
    progress = Progress(step=7, epoch=1, samples=224, eval_history=[{"step": 5, "accuracy": 0.5}])
    restored = Progress()
    restored.load_state_dict(progress.state_dict(elapsed_s=12.5))
    assert dataclasses.replace(restored, restarts=0, elapsed_before_s=0.0) == progress
    assert (restored.restarts, restored.elapsed_before_s) == (1, 12.5)


def test_a_checkpoint_restores_weights_optimizer_sampler_policy_and_progress(tmp_path: Path) -> None:
    state = _state(seed=0)
    _adopt_first_layout(state)
    _train_two_steps(state)
    assert state.freezer.frozen == frozenset({0}) and state.samples_done() == 16
    saver = Checkpointer(CheckpointConfig(), tmp_path, env())
    record = saver.save(state, started=0.0)
    assert record is not None and record["step"] == 2
    resumed = _state(seed=1)  # other initial weights: all of them must come from the checkpoint
    reader = Checkpointer(CheckpointConfig(resume="auto"), tmp_path, env())
    assert reader.resume(resumed)
    _adopt_first_layout(resumed)  # the optimizer state is installed as the parameters are held
    for (name, got), want in zip(resumed.model.state_dict().items(), state.model.state_dict().values(), strict=True):
        assert torch.equal(got, want), name
    saved, restored = state.optimizer.state_dict(), resumed.optimizer.state_dict()
    assert saved.keys() == restored.keys() and all(torch.equal(restored[k], v) for k, v in saved.items())
    assert (resumed.sampler.epoch, resumed.sampler.position) == (0, 16) and resumed.samples_done() == 16
    assert resumed.freezer.frozen == frozenset({0}) and not resumed.model.blocks[1][0].weight.requires_grad
    assert (resumed.progress.step, resumed.progress.samples, resumed.progress.restarts) == (2, 16, 1)


def test_nothing_is_written_or_kept_with_checkpoints_off_and_the_best_weights_come_back(tmp_path: Path) -> None:
    state = _state(seed=0)
    _adopt_first_layout(state)
    off = Checkpointer(CheckpointConfig(enabled=False), tmp_path, env())
    assert off.save(state, started=0.0) is None and off.best() is None
    assert not off.resume(state) and not list(tmp_path.iterdir())
    on = Checkpointer(CheckpointConfig(), tmp_path, env())
    on.save_best(state.model, step=4, metric="accuracy", value=0.75)
    best = on.best()
    assert best is not None and best.step == 4 and best.meta == {"validation_accuracy": 0.75}
    assert best.weights.keys() == state.model.state_dict().keys()
