"""The integrations benchmark's arithmetic on made-up runs: the speed ratio, the paired accuracy change and its
error, the target."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from benchmark_scripts import load_benchmark
from pipetransformer.config import ConfigError
from pipetransformer.report import combined_se

integrations = load_benchmark("integrations")


def _result(configuration: str, seed: int, train_s: float, correct: list[int] | None) -> dict[str, Any]:
    rows = correct if correct is not None else [1, 1, 1, 0]
    result = {"configuration": configuration, "seed": seed, "train_s": train_s, "samples_per_s": 1.0,
              "test_accuracy": sum(rows) / len(rows), "decisions": [], "outcome": None,
              "load_before": 2.0, "load_after": 2.0}
    if correct is not None:
        result["test_correct"] = correct
    return result


def test_the_accuracy_change_is_paired_by_row_when_the_runs_kept_their_rows() -> None:
    base = [[1] * 200, [1] * 199 + [0]]
    auto = [[1] * 199 + [0], [0] + [1] * 199]
    results = [_result("baseline", s, 100.0, base[s]) for s in (0, 1)] + \
              [_result("autofreeze", s, t, auto[s]) for s, t in ((0, 50.0), (1, 80.0))]
    summary = integrations.summarize(results)
    difference, se = combined_se(auto, base)
    assert summary["accuracy_points_mean_change"] == pytest.approx(difference * 100) == pytest.approx(-0.25)
    assert summary["accuracy_points_se"] == pytest.approx(se * 100) and summary["se_includes_test_rows"]
    assert summary["speed_ratio_median"] == pytest.approx((2.0 + 1.25) / 2)
    assert summary["target_met"]  # 1.625x at -0.25 points
    assert "over the seeds and the test rows" in integrations._markdown(summary, results, "made up")


def test_without_rows_the_error_is_the_seeds_spread_and_the_target_can_fail() -> None:
    results = [_result("baseline", s, 100.0, None) for s in (0, 1, 2)] + \
              [_result("autofreeze", s, 90.0, None) for s in (0, 1, 2)]
    results[3]["test_accuracy"] -= 0.02  # autofreeze seed 0: 2 points down
    summary = integrations.summarize(results)
    deltas = [-2.0, 0.0, 0.0]
    assert summary["accuracy_points_mean_change"] == pytest.approx(-2 / 3)
    assert summary["accuracy_points_se"] == pytest.approx(
        math.sqrt(sum((d + 2 / 3) ** 2 for d in deltas) / 2) / math.sqrt(3))
    assert not summary["se_includes_test_rows"]
    assert not summary["target_met"]  # 1.11x and -0.67 points: both miss
    assert "over the seeds only" in integrations._markdown(summary, results, "made up")


def test_a_finished_run_is_reused_and_a_different_split_seed_is_refused(tmp_path: Path) -> None:
    recorded = {**_result("baseline", 0, 100.0, [1, 0]), "wall_s": 120.0, "split_seed": 7}
    (tmp_path / "baseline-seed0.done.json").write_text(json.dumps(recorded))
    assert integrations._run("baseline", 0, False, 7, tmp_path, False) == recorded  # no process started
    with pytest.raises(SystemExit, match="--split-seed 7, not 8"):
        integrations._run("baseline", 0, False, 8, tmp_path, False)


def test_freeze_settings_other_than_the_default_are_parsed_as_the_cli_does_and_wrong_ones_stop_the_launch() -> None:
    assert integrations.freeze_settings([]) == integrations.FreezeConfig()
    prior_alone = integrations.freeze_settings(["freeze.policy=none", "freeze.prior=2"])
    assert (prior_alone.policy, prior_alone.prior) == ("none", 2)
    with pytest.raises(SystemExit, match="only freeze settings apply here"):
        integrations.freeze_settings(["train.lr=1e-3"])
    with pytest.raises(ConfigError, match="unknown key 'freeze.polcy'"):
        integrations.main(["--set", "freeze.polcy=none", "--out", "/nonexistent/never-made"])
