"""A task the trainer never names, in one process: the regression's metric is the one in every record and choice."""

from __future__ import annotations

import json
from pathlib import Path

from jobs import event_scalars

from pipetransformer.config import load_config
from pipetransformer.train import regression, train

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_vit.yaml"


def test_a_regression_is_evaluated_in_its_metric_and_its_best_is_the_lowest(tmp_path: Path) -> None:
    summary = train(load_config(CONFIG, [f"run.dir={tmp_path}", "train.max_steps=6", "train.eval_every_steps=2",
                                         "freeze.enabled=true", "freeze.policy=schedule",
                                         "freeze.interval_unit=steps", "freeze.schedule=[[2,2]]",
                                         "cache.enabled=true"]), task=regression())
    history = summary["eval_history"]
    assert [e["step"] for e in history] == [2, 4, 6] and "accuracy" not in summary
    assert summary["best_eval_mae"] == min(e["mae"] for e in history)
    best = min(history, key=lambda e: e["mae"])  # the first of equal errors
    assert summary["best_validation_step"] == best["step"] and summary["test_mae_at_best_validation"] is not None
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["mae"] for r in records if r["event"] == "eval"] == [e["mae"] for e in history]
    assert [step for step, _ in event_scalars(tmp_path / "tensorboard", "eval/mae")] == [2, 4, 6]
