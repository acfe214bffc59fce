"""``pipetransformer report``: plots and markdown from one real run directory (2 workers, a layout change)
and from hand-written run directories whose numbers are known."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from jobs import event_scalars, logged_records, run_job
from matplotlib.image import imread

from pipetransformer.cli import main
from pipetransformer.report import (OTHER_PHASE, RunDirError, combined_se, layout_segments, load_run,
                                    paired_test_difference, phase_means, run_labels, speedup, write_report,
                                    write_tensorboard)

IMAGES = ("throughput.png", "layout.png", "accuracy.png", "breakdown.png")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PERF_COUNTER_START = 5000.0  # step records carry raw perf_counter timestamps
LAYOUT_CHANGE = ("train.max_steps=8", "pipe.enabled=true", "dp.enabled=true", "pipe.device_memory_gb=0.008",
                 "freeze.enabled=true", "freeze.policy=schedule", "freeze.interval_unit=steps",
                 "freeze.schedule=[[3,2]]", "cache.enabled=true")


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("real") / "run"
    run_job("tiny_vit.yaml", run_dir, *LAYOUT_CHANGE, nproc=2)
    return run_dir


def _step(step: int, wall_s: float, step_s: float, frozen: int = 0, stages: int = 1, dp: int = 1,
          micro: int = 1, **phases: float) -> dict[str, Any]:
    return {"event": "step", "step": step, "epoch": 0, "loss": 2.0, "lr": 1e-3, "samples_per_s": 16 / step_s,
            "step_s": step_s, "global_batch": 16, "frozen_layers": frozen, "stages": stages, "dp_width": dp,
            "micro_batches": micro, "allreduce_bytes": 0, "wall_s": wall_s, **{f"{k}_s": v for k, v in phases.items()}}


def _write_run(path: Path, name: str, wall_time_s: float, steps: int = 4, accuracy: float = 0.5,
               samples_per_step: int = 16, metrics: list[dict[str, Any]] | None = None) -> Path:
    """A run directory as the trainer writes it: uniform steps filling ``wall_time_s``."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({"run": {"name": name}, "freeze": {"enabled": False}}))
    step_s = wall_time_s / steps
    if metrics is None:
        metrics = [_step(i, PERF_COUNTER_START + i * step_s, step_s, data=step_s / 4, forward=step_s / 4,
                         backward=step_s / 4) for i in range(1, steps + 1)]
        metrics.append({"event": "eval", "epoch": 0, "step": steps, "accuracy": accuracy, "wall_s": wall_time_s})
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    summary = {"eval_accuracy": accuracy, "best_eval_accuracy": accuracy,
               "eval_history": [{"epoch": 0, "step": steps, "accuracy": accuracy, "wall_s": wall_time_s}],
               "wall_time_s": wall_time_s, "train_samples": steps * samples_per_step, "steps": steps,
               "world_size": 1, "layout_history": [], "transitions": [], "freeze_decisions": [],
               "samples_per_s": steps * samples_per_step / wall_time_s, "run_dir": str(path), "rank_fingerprints": []}
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def _row(markdown: str, field: str) -> str:
    """The value cell of a ``| field | value |`` row (the first one)."""
    match = re.search(rf"^\| {re.escape(field)} \| (.*?) \|$", markdown, flags=re.MULTILINE)
    assert match is not None, f"no row {field!r} in the report"
    return match.group(1)


def _table_rows(markdown: str, header_start: str) -> list[list[str]]:
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _assert_images(out: Path) -> None:
    for name in IMAGES:
        path = out / name
        assert path.read_bytes()[:len(PNG_SIGNATURE)] == PNG_SIGNATURE, name
        pixels = imread(path)
        assert pixels.ndim == 3 and np.ptp(pixels) > 0, f"{name} is blank"


def test_report_of_a_real_run_matches_its_summary(real_run: Path) -> None:
    out = write_report([real_run], None)
    assert out == real_run / "report"
    _assert_images(out)
    markdown = (out / "report.md").read_text()
    summary = json.loads((real_run / "summary.json").read_text())
    assert _row(markdown, "config name") == "tiny_vit"
    assert _row(markdown, "automations") == "freeze (schedule), pipe (gpipe), dp, cache"
    assert _row(markdown, "world size") == str(summary["world_size"]) == "2"
    assert _row(markdown, "final validation accuracy") == f"{summary['eval_accuracy']:.4f}"
    assert _row(markdown, "best validation accuracy") == f"{summary['best_eval_accuracy']:.4f}"
    assert _row(markdown, "test accuracy (final model)") == f"{summary['test_accuracy']:.4f}"
    assert _row(markdown, "freeze outcome") == summary["freeze_outcome"]
    assert _row(markdown, "wall time (s)") == f"{summary['wall_time_s']:.3f}"
    assert _row(markdown, "samples/s") == f"{summary['samples_per_s']:.2f}"
    [transition] = summary["transitions"]
    assert _row(markdown, "layout transitions") == f"1 ({transition['seconds']:.3f} s in total)"
    assert _table_rows(markdown, "| step | seconds | blocks moved")[0][:3] == \
        [str(transition["step"]), f"{transition['seconds']:.3f}", str(transition["blocks_moved"])]
    [decision] = summary["freeze_decisions"]
    assert _table_rows(markdown, "| step | epoch | frozen layers |") == [[str(decision["step"]), "0", "0, 1"]]
    assert "## Comparison" not in markdown  # one run: nothing to compare with
    for name in IMAGES:
        assert f"]({name})" in markdown


def test_real_run_time_axis_and_layout_segments(real_run: Path) -> None:
    run = load_run(real_run)
    summary = run.summary
    assert [s["step"] for s in run.steps] == list(range(1, summary["steps"] + 1))
    assert run.steps[0]["wall_s"] == pytest.approx(run.steps[0]["step_s"])
    assert run.steps[-1]["wall_s"] <= run.evals[-1]["wall_s"] <= summary["wall_time_s"]
    segments = layout_segments(run.steps)
    history = summary["layout_history"]
    assert [(g.first_step - 1, g.frozen_layers, g.stages, g.dp_width, g.micro_batches) for g in segments] == \
        [(h["step"], h["frozen_layers"], h["stages"], h["dp_width"], h["micro_batches"]) for h in history]
    for segment in segments:
        steps = [s for s in run.steps if segment.first_step <= s["step"] <= segment.last_step]
        assert sum(segment.phase_means.values()) == pytest.approx(np.mean([s["step_s"] for s in steps]))


def test_speed_up_is_relative_to_the_first_run(tmp_path: Path) -> None:
    walls = (10.0, 4.0, 20.0)
    dirs = [_write_run(tmp_path / f"run{i}", f"config{i}", wall) for i, wall in enumerate(walls)]
    out = write_report(dirs, tmp_path / "out")
    _assert_images(out)
    markdown = (out / "report.md").read_text()
    assert "Baseline: the first run given, **config0**" in markdown
    rows = _table_rows(markdown, "| run | wall time (s) | speed-up |")
    assert [r[0] for r in rows] == ["config0", "config1", "config2"]
    assert [r[2] for r in rows] == ["1.000", "2.500", "0.500"]
    assert [r[4] for r in rows] == ["1.000", "2.500", "0.500"]  # same samples: same ratio as wall time
    assert "different numbers of samples" not in markdown
    assert speedup(10.0, 4.0) == 2.5
    with pytest.raises(ValueError, match="wall time must be positive"):
        speedup(10.0, 0.0)


def test_runs_with_different_work_are_flagged(tmp_path: Path) -> None:
    a = _write_run(tmp_path / "a", "a", 10.0, steps=4)
    b = _write_run(tmp_path / "b", "b", 10.0, steps=8)
    markdown = (write_report([a, b], None) / "report.md").read_text()
    rows = _table_rows(markdown, "| run | wall time (s) | speed-up |")
    assert [(r[2], r[4]) for r in rows] == [("1.000", "1.000"), ("1.000", "2.000")]
    assert "different numbers of samples" in markdown
    assert (a / "report" / "report.md").is_file()


def test_test_metrics_are_paired_sample_by_sample_with_the_test_sets_error(tmp_path: Path) -> None:
    baseline, run, unscored = (_write_run(tmp_path / name, name, 10.0) for name in ("base", "run", "unscored"))
    for path, final in ((baseline, [1, 1, 0, 0]), (run, [1, 0, 1, 1])):
        (path / "test_samples.json").write_text(json.dumps({"metric": "accuracy", "final": final,
                                                            "at_best_validation": None}))
    rows = _table_rows((write_report([baseline, run, unscored], None) / "report.md").read_text(),
                       "| run | wall time (s) | speed-up |")
    # differences 0, -1, +1, +1: mean 0.25, sample standard deviation sqrt(2.75 / 3), over sqrt(4)
    assert [r[-1] for r in rows] == ["+0.0000 ± 0.0000", "+0.2500 ± 0.4787", "n/a"]


def test_the_paired_difference_averages_seeds_per_sample_before_the_test_sets_error() -> None:
    # two seeds that disagree on every sample cancel: no difference and no spread left over the test set
    difference, se = paired_test_difference([[1, 0, 1], [0, 1, 0]], [[0, 1, 0], [1, 0, 1]])
    assert difference == 0.0 and se == 0.0
    difference, se = paired_test_difference([[1, 1], [1, 0]], [[0, 0], [0, 0]])
    assert difference == 0.75 and se == pytest.approx(0.25)  # per sample 1.0 and 0.5
    with pytest.raises(ValueError, match="pair each run with one baseline"):
        paired_test_difference([[1, 0]], [])
    with pytest.raises(ValueError, match="same, non-empty test split"):
        paired_test_difference([[1, 0]], [[1]])


def test_combined_error_adds_the_seeds_spread_to_the_test_sets_own() -> None:
    runs = [[1, 1, 0, 1], [1, 0, 0, 1]]
    baselines = [[1, 1, 1, 1], [1, 1, 0, 1]]
    difference, se = combined_se(runs, baselines)
    assert difference == pytest.approx(-0.25)
    per_row = [0.0, -0.5, -0.5, 0.0]  # per row, averaged over the seeds
    row_se = math.sqrt(sum((d + 0.25) ** 2 for d in per_row) / 3) / 2
    seed_se = math.sqrt(((-0.25 + 0.25) ** 2 + (-0.25 + 0.25) ** 2) / 1) / math.sqrt(2)
    assert se == pytest.approx(math.hypot(seed_se, row_se))


def test_phase_means_add_up_to_the_step_time() -> None:
    steps = [_step(1, 1.0, 1.0, data=0.1, forward=0.3, backward=0.4),
             _step(2, 1.5, 0.5, data=0.1, forward=0.1, backward=0.2, allreduce=0.05)]
    means = phase_means(steps)
    assert list(means) == ["data", "forward", "backward", "allreduce", OTHER_PHASE]
    assert means["forward"] == pytest.approx(0.2)
    assert means["allreduce"] == pytest.approx(0.025)  # missing in step 1: counts 0
    assert means[OTHER_PHASE] == pytest.approx(((1.0 - 0.8) + (0.5 - 0.45)) / 2)
    assert sum(means.values()) == pytest.approx(0.75)


def test_layout_segments_split_where_the_layout_changes() -> None:
    steps = [_step(1, 1.0, 1.0, stages=2, micro=2, forward_backward=0.9),
             _step(2, 2.0, 1.0, stages=2, micro=2, forward_backward=0.7),
             _step(3, 2.5, 0.5, frozen=2, dp=2, forward=0.2, backward=0.2)]
    first, second = layout_segments(steps)
    assert (first.first_step, first.last_step, first.logged_steps, first.stages, first.micro_batches) == (1, 2, 2, 2, 2)
    assert first.phase_means["forward_backward"] == pytest.approx(0.8)
    assert (second.first_step, second.frozen_layers, second.dp_width) == (3, 2, 2)
    assert "forward_backward" not in second.phase_means


def test_a_reused_run_directory_reports_its_last_run(tmp_path: Path) -> None:
    old = [_step(i, 100.0 + i, 1.0, stages=2) for i in (1, 2, 3)]
    new = [_step(i, 900.0 + i * 0.5, 0.5) for i in (1, 2)]
    eval_record = {"event": "eval", "epoch": 0, "step": 2, "accuracy": 0.5, "wall_s": 1.0}
    run_dir = _write_run(tmp_path / "run", "reused", 1.0, steps=2, metrics=[*old, *new, eval_record])
    run = load_run(run_dir)
    assert [(s["step"], s["stages"]) for s in run.steps] == [(1, 1), (2, 1)]
    assert [s["wall_s"] for s in run.steps] == pytest.approx([0.5, 1.0])


def test_a_truncated_last_line_is_ignored_but_a_damaged_one_is_not(tmp_path: Path) -> None:
    run_dir = _write_run(tmp_path / "run", "killed", 4.0)
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"event": "step", "st')
    assert len(load_run(run_dir).steps) == 4
    metrics.write_text('{"event": \n' + metrics.read_text())
    with pytest.raises(RunDirError, match=r"metrics.jsonl line 1 is not valid JSON"):
        load_run(run_dir)


def test_labels_are_config_names_made_unique_by_directory(tmp_path: Path) -> None:
    a = load_run(_write_run(tmp_path / "a", "same", 1.0))
    b = load_run(_write_run(tmp_path / "b", "same", 1.0))
    c = load_run(_write_run(tmp_path / "c", "other", 1.0))
    assert run_labels([a, c]) == ["same", "other"]
    assert run_labels([a, b]) == ["same (a)", "same (b)"]


@pytest.mark.parametrize("missing", ["summary.json", "metrics.jsonl", "config.yaml"])
def test_a_directory_that_is_not_a_run_directory_is_named(tmp_path: Path, missing: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _write_run(tmp_path / "run", "broken", 1.0)
    (run_dir / missing).unlink()
    with pytest.raises(RunDirError, match=rf"not a run directory: missing {re.escape(missing)} "):
        write_report([run_dir], None)
    assert main(["report", str(run_dir)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and error.startswith("error: ") and missing in error
    assert not (run_dir / "report").exists()


def test_a_missing_directory_is_named(tmp_path: Path) -> None:
    good = _write_run(tmp_path / "good", "good", 1.0)
    with pytest.raises(RunDirError, match="nowhere is not a directory"):
        write_report([good, tmp_path / "nowhere"], None)


def test_tensorboard_absent_writes_no_event_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # how Python spells "not importable"
    run_dir = _write_run(tmp_path / "run", "plain", 2.0)
    assert write_tensorboard(run_dir, tmp_path / "tb") is None
    assert not (tmp_path / "tb").exists()


def test_training_logs_tensorboard_scalars_live(real_run: Path, tmp_path: Path) -> None:
    """The 2-worker run's own event files hold what its metrics.jsonl holds, through its layout change."""
    live = real_run / "tensorboard"
    steps = logged_records(real_run, "step")
    assert event_scalars(live, "train/loss") == [(s["step"], pytest.approx(s["loss"])) for s in steps]
    assert event_scalars(live, "layout/dp_width") == [(s["step"], s["dp_width"]) for s in steps]
    assert {1, 2} <= {width for _, width in event_scalars(live, "layout/dp_width")}, "the run changes its width"
    assert event_scalars(live, "eval/accuracy") == \
        [(e["step"], pytest.approx(e["accuracy"])) for e in logged_records(real_run, "eval")]
    assert event_scalars(live, "freeze/frozen_layers") == [(3, 2.0)]
    out = write_report([real_run], tmp_path / "report")
    assert f"`{live}`" in (out / "report.md").read_text()
    assert not (out / "tensorboard").exists(), "a run with live event files is not converted again"


def test_tensorboard_conversion_holds_the_metrics(tmp_path: Path) -> None:
    run_dir = _write_run(tmp_path / "run", "tb", 2.0, steps=4, accuracy=0.75)
    out = write_tensorboard(run_dir, tmp_path / "tb")
    assert out == tmp_path / "tb"
    steps = logged_records(run_dir, "step")
    assert event_scalars(out, "train/loss") == [(s["step"], s["loss"]) for s in steps]
    assert [v for _, v in event_scalars(out, "time/forward_s")] == pytest.approx([s["forward_s"] for s in steps])
    assert [v for _, v in event_scalars(out, "layout/stages")] == [1.0] * len(steps)
    assert event_scalars(out, "eval/accuracy") == [(4, 0.75)]
    report = write_report([run_dir], None)
    assert (report / "tensorboard" / "tb").is_dir(), "a run without live event files is converted"
    assert f"`{report / 'tensorboard' / 'tb'}`" in (report / "report.md").read_text()
