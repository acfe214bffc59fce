"""A task the trainer never names, through the Python API: regression of a digit's value on 2 workers with freezing,
a pipeline compressed into replicas and the cache on (``examples/regression_from_python.py``, run as a user runs it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import logged_records, summary
from pipetransformer.config import load_config
from pipetransformer.data import datasets_from_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "regression_from_python.py"
TIMEOUT_S = 600
LEARNED = 0.6  # of the error of always predicting the training mean


def _mean_predictor_mae() -> float:
    """The test error of always predicting the training labels' mean, on the example's data."""
    sys.path.insert(0, str(EXAMPLE.parent))
    from regression_from_python import CONFIG, OVERRIDES

    splits = datasets_from_config(load_config(CONFIG, OVERRIDES).data, tokenizer=None)
    mean = float(splits.train.labels.float().mean())
    return float((splits.test.labels.float() - mean).abs().mean())


def test_a_regression_trains_on_two_workers_with_freezing_and_is_tested(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([sys.executable, str(EXAMPLE), str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-4000:]
    run = summary(tmp_path)
    assert run["world_size"] == 2 and run["test_mae"] < LEARNED * _mean_predictor_mae(), run["test_mae"]
    assert run["test_mae_at_best_validation"] is not None and run["best_eval_mae"] == min(
        e["mae"] for e in run["eval_history"])
    assert [d["frozen"] for d in run["freeze_decisions"]][:2] == [[0, 1], [0, 1, 2]]
    layouts = [(h["stages"], h["dp_width"]) for h in run["layout_history"]]
    assert layouts[0] == (2, 1) and layouts[-1] == (1, 2), layouts
    assert all(r["split"] == "validation" and "mae" in r for r in logged_records(tmp_path, "eval"))
    assert '"test_mae"' in result.stdout
