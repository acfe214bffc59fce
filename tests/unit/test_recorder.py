"""RunRecorder on its own: which steps are recorded, with what; summaries in the task's metric; a resume's logs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from pipetransformer.config import PipeConfig, load_config
from pipetransformer.metrics import StepTimer
from pipetransformer.pipe.planner import plan_layout
from pipetransformer.train.elastic import UNIFORM_COST
from pipetransformer.train.recorder import CONFIG_FILE, SAMPLE_LOG_PREFIX, RunRecorder
from pipetransformer.train.state import Progress
from pipetransformer.train.step import StepResult
from pipetransformer.train.task import regression
from tiny import CPU, LAYERS, env

LOG_EVERY = 3
PLAN = plan_layout(PipeConfig(), [UNIFORM_COST] * (LAYERS + 2), 1, elastic=False, batch_size=8, frozen_blocks=0,
                   cached_blocks=0)


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _recorder(run_dir: Path, resumed_at: int | None = None) -> RunRecorder:
    config = load_config(None, [f"run.log_every={LOG_EVERY}", "run.progress=false", "run.tensorboard=false",
                                "run.record_samples=true"])
    return RunRecorder(run_dir, config, env(), resumed_at=resumed_at, cache_metrics=lambda: None)


def _steps(recorder: RunRecorder, steps: range) -> None:
    progress = Progress()
    for step in steps:
        progress.step = step
        timer = StepTimer(CPU)
        with timer.phase("forward"):
            pass
        recorder.step(progress, StepResult(0.5, 1e-3, 0, [1.0] * LAYERS, None, None, False), 8, timer, PLAN, 0)
        recorder.samples(0, step, [step])
        if step % LOG_EVERY == 0:
            recorder.checkpoint({"step": step})


def test_the_first_step_and_every_log_every_th_are_recorded_with_the_layout(tmp_path: Path) -> None:
    recorder = _recorder(tmp_path)
    _steps(recorder, range(1, 8))
    recorder.write_config(load_config(None))
    recorder.close()
    steps = [r for r in _records(tmp_path) if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 3, 6]
    assert steps[0]["stages"] == 1 and steps[0]["layer_grad_norms"] == [1.0] * LAYERS and "forward_s" in steps[0]
    assert "layer_grad_dots" not in steps[0] and not any(key.startswith("cache_") for key in steps[0])
    assert yaml.safe_load((tmp_path / CONFIG_FILE).read_text())["seed"] == 0


def test_a_resume_cuts_the_logs_back_to_its_checkpoint(tmp_path: Path) -> None:
    first = _recorder(tmp_path)
    _steps(first, range(1, 8))  # killed after step 7; the checkpoint was at step 6
    first.close()
    resumed = _recorder(tmp_path, resumed_at=6)
    _steps(resumed, range(7, 10))
    resumed.close()
    assert [r["step"] for r in _records(tmp_path) if r["event"] == "step"] == [1, 3, 6, 9]
    samples = [json.loads(line)["step"] for line in (tmp_path / f"{SAMPLE_LOG_PREFIX}0.jsonl").read_text().splitlines()]
    assert samples == list(range(1, 10)), "step 7 is recorded once"


def test_the_summary_speaks_the_tasks_metric(tmp_path: Path) -> None:
    recorder = _recorder(tmp_path)
    progress = Progress(step=4, samples=32, eval_history=[{"step": 2, "mae": 1.5}, {"step": 4, "mae": 1.25}])
    summary = recorder.summary(progress, 2.0, regression(), fingerprints=[[0.0, 1.0]], memory=[[3e8, 5e8]],
                               freeze_cap_binds=0, world_size=1)
    recorder.close()
    assert (summary["eval_mae"], summary["best_eval_mae"], summary["samples_per_s"]) == (1.25, 1.25, 16.0)
    assert (summary["rss_before_model_bytes"], summary["peak_rss_bytes"]) == ([300_000_000], [500_000_000])
