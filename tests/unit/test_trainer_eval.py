"""Evaluation through the frozen-prefix cache, and when evaluations happen (one process, tiny model)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pipetransformer.config import load_config
from pipetransformer.train import Trainer

ROOT = Path(__file__).resolve().parents[2]
FREEZE_TWO_AT_STEP_ONE = ("freeze.enabled=true", "freeze.policy=schedule", "freeze.interval_unit=steps",
                          "freeze.schedule=[[1,2]]", "cache.enabled=true")


def _trainer(tmp_path: Path, *overrides: str) -> Trainer:
    return Trainer(load_config(ROOT / "configs" / "tiny_text.yaml",
                               [f"run.dir={tmp_path}", "checkpoint.enabled=false", *overrides]))


def test_cached_evaluation_equals_a_plain_forward_and_hits_the_second_time(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, *FREEZE_TWO_AT_STEP_ONE, "train.max_steps=2")
    try:
        trainer.fit()  # its final evaluation filled the evaluation records at the frozen boundary
        assert trainer.layout.plan.cached_blocks == 3 and trainer.cache.evaluation is not None
        batch = trainer.eval_set.get_batch(list(range(trainer.config.train.eval_batch_size)))
        before = trainer.cache.evaluation.metrics()
        trainer.model.eval()
        cached = trainer.evaluator.outputs(batch)
        plain = trainer.evaluator.outputs(batch, use_cache=False)
        after = trainer.cache.evaluation.metrics()
        assert after.hits - before.hits == len(batch), "the evaluation batch was not served from the cache"
        assert after.computed == before.computed
        assert torch.equal(cached, plain)
        assert trainer.cache is not None
        assert trainer.cache.metrics().samples == 32, "evaluation counted in the training hit rate"
    finally:
        trainer.close()


def test_step_evaluations_replace_epoch_end_ones_and_the_final_model_is_evaluated(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, "train.epochs=2", "train.eval_every_steps=5")  # 8 steps per epoch
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    assert [e["step"] for e in summary["eval_history"]] == [5, 10, 15, 16]


def _train(tmp_path: Path, *overrides: str) -> tuple[dict[str, object], list[dict[str, object]]]:
    config = load_config(ROOT / "configs" / "tiny_text.yaml", [f"run.dir={tmp_path}", *overrides])
    trainer = Trainer(config)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return summary, records


COHERENCE_FREEZING = ("freeze.enabled=true", "freeze.policy=coherence", "freeze.interval=4",
                     "freeze.interval_unit=steps", "freeze.threshold=0.9", "freeze.alpha=0.5", "cache.enabled=true",
                     "train.eval_every_steps=4", "freeze.learned_min_steps=1")  # 4-step windows: one counts


def test_the_test_split_is_evaluated_once_at_the_end_and_never_steers_training(tmp_path: Path) -> None:
    summary, records = _train(tmp_path / "a", *COHERENCE_FREEZING, "data.max_test_samples=96")
    events = [r["event"] for r in records]
    assert events.count("test") == 1 and events.index("test") > max(i for i, e in enumerate(events) if e == "step")
    assert all(r["split"] == "validation" and r["samples"] == 128 for r in records if r["event"] == "eval")
    assert summary["test_samples"] == 96 and 0.0 <= summary["test_accuracy"] <= 1.0
    assert summary["freeze_decisions"], "the run should freeze, so freeze decisions are compared below"
    windows = [r for r in records if r["event"] == "freeze_window"]  # every window's numbers, frozen or not
    assert [w["step"] for w in windows] == list(range(4, summary["steps"] + 1, 4))
    assert len(windows) > len(summary["freeze_decisions"])
    frozen_after = {w["step"]: w["frozen"] for w in windows}
    assert all(frozen_after[d["step"]] == d["frozen"] for d in summary["freeze_decisions"])
    best = max(summary["eval_history"], key=lambda e: e["accuracy"])  # the first of equal accuracies
    assert summary["best_validation_step"] == best["step"]
    assert summary["test_accuracy_at_best_validation"] is not None
    per_sample = json.loads((tmp_path / "a" / "test_samples.json").read_text())
    assert per_sample["metric"] == "accuracy" and len(per_sample["final"]) == 96
    for key, field in (("final", "test_accuracy"), ("at_best_validation", "test_accuracy_at_best_validation")):
        assert set(per_sample[key]) <= {0.0, 1.0} and sum(per_sample[key]) / 96 == summary[field]
    # Another test split (a subset of it) changes nothing before the test: training never reads it.
    other, other_records = _train(tmp_path / "b", *COHERENCE_FREEZING, "data.max_test_samples=32")
    assert other["test_samples"] == 32

    def training(rs: list[dict[str, object]]) -> list[dict[str, object]]:
        """Everything but timings."""
        return [{k: v for k, v in r.items() if not k.endswith("_s") and "seconds" not in k}
                for r in rs if r["event"] in ("step", "eval", "freeze")]

    assert training(other_records) == training(records)
