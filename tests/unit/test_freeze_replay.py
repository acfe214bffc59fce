"""``pipetransformer replay``: a run's logged gradient norms through a freeze policy, as the trainer feeds it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipetransformer.cli import EXIT_USER_ERROR, main
from pipetransformer.freeze.policies import make_policy
from pipetransformer.freeze.replay import ReplayError, read_logged_steps, replay

NUM_LAYERS = 4
STEPS_PER_EPOCH = 5


def norms(step: int) -> list[float]:
    """Layers 0-1 constant, layers 2-3 halving every step: the bottom two look converged from the start."""
    return [1.0, 1.0, 0.5**step, 0.5**step]


def write_run(run_dir: Path, steps: int, *, every: int = 1, freeze_at: int | None = None,
              log_every: int = 1) -> Path:
    """``every``: the steps the metrics hold; ``log_every``: the setting config.yaml records."""
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("freeze: {policy: gradient, interval: 2, interval_unit: steps, alpha: 1.0, "
                                          f"max_fraction: 0.5}}\nrun: {{log_every: {log_every}}}\n")
    with (run_dir / "metrics.jsonl").open("w") as out:
        for step in range(1, steps + 1):
            if step % every == 0:
                record = {"event": "step", "step": step, "epoch": (step - 1) // STEPS_PER_EPOCH,
                          "loss": 1.0, "layer_grad_norms": norms(step)}
                out.write(json.dumps(record) + "\n")
            if step == freeze_at:
                out.write(json.dumps({"event": "freeze", "step": step, "frozen": [0]}) + "\n")
    return run_dir


def test_replay_takes_the_decisions_the_policy_takes_live(tmp_path: Path) -> None:
    steps = read_logged_steps(write_run(tmp_path / "run", 10) / "metrics.jsonl")
    settings = {"interval": 2, "interval_unit": "steps", "alpha": 1.0, "percentile": 50.0, "max_fraction": 1.0,
                "seed": 0}
    live = make_policy("gradient", NUM_LAYERS, **settings)
    expected = []
    for logged in steps:  # the trainer's calls, written out
        live.observe(logged.layer_grad_norms)
        expected.append(live.decide(logged.step, logged.epoch, epoch_end=False))
        if logged.step % STEPS_PER_EPOCH == 0:
            expected.append(live.decide(logged.step, logged.epoch, epoch_end=True))
    decisions = replay(make_policy("gradient", NUM_LAYERS, **settings), steps)
    assert decisions == [d for d in expected if d is not None]
    assert [(d.step, sorted(d.frozen)) for d in decisions] == [(4, [0, 1])]


def test_replay_command_prints_decisions_with_overrides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = write_run(tmp_path / "run", 10)
    assert main(["replay", str(run_dir)]) == 0
    assert "step 4 (epoch 0): 2 layers frozen [0, 1]" in capsys.readouterr().out
    assert main(["replay", str(run_dir), "--set", "freeze.policy=none", "--set", "freeze.prior=auto"]) == 0
    # --set reaches the policy, which gives its own account of why (the run's model is pretrained: the prior auto
    # froze a third of its 3 layers)
    assert "nothing froze beyond the prior's 1 layer: freeze.policy is none" in capsys.readouterr().out


@pytest.mark.parametrize(("every", "freeze_at", "message"), [
    (2, None, "rerun the run with --set run.log_every=1"),
    (1, 3, "replay a run that froze nothing"),
])
def test_replay_refuses_runs_it_cannot_replay_exactly(tmp_path: Path, capsys: pytest.CaptureFixture[str], every: int,
                                                      freeze_at: int | None, message: str) -> None:
    run_dir = write_run(tmp_path / "run", 10, every=every, freeze_at=freeze_at)
    with pytest.raises(ReplayError, match=message):
        read_logged_steps(run_dir / "metrics.jsonl")
    assert main(["replay", str(run_dir)]) == EXIT_USER_ERROR
    assert message in capsys.readouterr().err


def test_replay_of_a_run_logged_every_10_steps_names_the_setting(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The default run.log_every: the command says which setting to train with, not what the policy lacks."""
    run_dir = write_run(tmp_path / "run", 25, every=10, log_every=10)
    assert main(["replay", str(run_dir)]) == EXIT_USER_ERROR
    assert "trained with run.log_every=10" in capsys.readouterr().err


def test_replay_of_a_missing_run_says_what_to_give(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["replay", str(tmp_path / "nowhere")]) == EXIT_USER_ERROR
    assert "give a run directory" in capsys.readouterr().err

