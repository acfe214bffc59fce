"""Evaluation through the frozen-prefix cache, and when evaluations happen (one process, tiny model)."""

from __future__ import annotations

from pathlib import Path

import torch

from pipetransformer.config import load_config
from pipetransformer.trainer import Trainer

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
        assert trainer.held.plan.cached_blocks == 3 and trainer.eval_cache is not None
        batch = trainer.eval_set.get_batch(list(range(trainer.config.train.eval_batch_size)))
        before = trainer.eval_cache.metrics()
        trainer.model.eval()
        cached = trainer.eval_logits(batch)
        plain = trainer.eval_logits(batch, use_cache=False)
        after = trainer.eval_cache.metrics()
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
