"""The run's metrics log: metrics.jsonl, and the same records as TensorBoard scalars."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from jobs import event_scalars

from pipetransformer.metrics import MetricsLog, eval_metric, tensorboard_scalars, truncate_log


def _step(step: int, **fields: Any) -> dict[str, Any]:
    return {"event": "step", "step": step, "epoch": 0, "loss": 2.0 / step, "lr": 1e-3, "samples_per_s": 32.0,
            "step_s": 0.5, "global_batch": 16, "frozen_layers": 0, "stages": 1, "dp_width": 1, "micro_batches": 1,
            "allreduce_bytes": 0, "wall_s": 0.5 * step, **fields}


def test_tensorboard_scalars_group_each_record() -> None:
    record = _step(2, frozen_layers=2, dp_width=2, micro_batches=4, forward_backward_s=0.3,
                   layer_grad_norms=[1.0, 2.0], cache_hit_rate=1.0, cache_seconds_saved=0.1, resumed=True)
    assert dict(tensorboard_scalars(record)) == {
        "train/loss": 1.0, "train/lr": 1e-3, "train/samples_per_s": 32.0, "train/global_batch": 16.0,
        "train/allreduce_bytes": 0.0, "train/cache_hit_rate": 1.0, "train/cache_seconds_saved": 0.1,
        "time/step_s": 0.5, "time/forward_backward_s": 0.3, "layout/frozen_layers": 2.0, "layout/stages": 1.0,
        "layout/dp_width": 2.0, "layout/micro_batches": 4.0}
    assert tensorboard_scalars({"event": "eval", "step": 3, "accuracy": 0.75}) == [("eval/accuracy", 0.75)]
    assert tensorboard_scalars({"event": "freeze", "step": 3, "frozen": [0, 1]}) == [("freeze/frozen_layers", 2.0)]
    assert tensorboard_scalars({"event": "checkpoint", "step": 3, "bytes": 10}) == []


def test_an_evaluation_is_scalar_in_its_tasks_metric() -> None:
    record = {"event": "eval", "split": "validation", "samples": 64, "epoch": 0, "step": 3, "mae": 1.25, "wall_s": 2.0}
    assert eval_metric([record]) == "mae" and eval_metric([]) == "accuracy"
    assert tensorboard_scalars(record) == [("eval/mae", 1.25)]


def test_after_flush_every_event_is_on_disk_while_the_run_goes_on(tmp_path: Path) -> None:
    """What the trainer's flush at a checkpoint promises: a run killed after it keeps the events up to it."""
    log = MetricsLog(tmp_path, append=False, tensorboard=True, next_step=1)
    try:
        for step in (1, 2, 3):
            log.write(_step(step))
        log.flush()
        assert event_scalars(tmp_path / "tensorboard", "train/loss") == [(1, 2.0), (2, 1.0), (3, pytest.approx(2 / 3))]
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    finally:
        log.close()


def test_a_resumed_log_replaces_the_steps_after_its_checkpoint(tmp_path: Path) -> None:
    """Steps 1-4 logged, killed, resumed from a checkpoint at step 2: TensorBoard and metrics.jsonl show 1, 2 and the
    new 3, 4; the killed attempt's records after its checkpoint record are gone, even those of step 2."""
    first = MetricsLog(tmp_path, append=False, tensorboard=True, next_step=1)
    for step in (1, 2):
        first.write(_step(step))
    first.write({"event": "checkpoint", "step": 2, "bytes": 10})
    first.write({"event": "eval", "step": 2, "accuracy": 0.5})  # the killed attempt's, after its checkpoint
    for step in (3, 4):
        first.write(_step(step))
    first.close()
    with (tmp_path / "metrics.jsonl").open("a") as log:
        log.write('{"event": "step", "st')  # killed mid-line
    resumed = MetricsLog(tmp_path, append=True, tensorboard=True, next_step=3)
    for step in (3, 4):
        resumed.write(_step(step, loss=10.0 + step))
    resumed.close()
    assert event_scalars(tmp_path / "tensorboard", "train/loss") == [(1, 2.0), (2, 1.0), (3, 13.0), (4, 14.0)]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["event"], r["step"], r.get("loss")) for r in records] == [
        ("step", 1, 2.0), ("step", 2, 1.0), ("checkpoint", 2, None), ("step", 3, 13.0), ("step", 4, 14.0)]


def test_truncating_a_log_without_checkpoint_records_keeps_the_steps_up_to_it(tmp_path: Path) -> None:
    """The per-rank sample logs have no checkpoint records: the first record of a later step is where they are cut."""
    path = tmp_path / "samples-rank0.jsonl"
    path.write_text("".join(json.dumps({"epoch": 0, "step": s, "indices": [s]}) + "\n" for s in (1, 2, 3, 2)))
    truncate_log(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    truncate_log(tmp_path / "missing.jsonl", 2)  # nothing logged yet: nothing to do
    assert not (tmp_path / "missing.jsonl").exists()


def test_without_tensorboard_only_the_json_log_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # how Python spells "not importable"
    log = MetricsLog(tmp_path, append=False, tensorboard=True, next_step=1)
    log.write(_step(1))
    log.flush()
    log.close()
    assert (tmp_path / "metrics.jsonl").is_file()
    assert not (tmp_path / "tensorboard").exists()


def test_tensorboard_off_writes_no_event_files(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path, append=False, tensorboard=False, next_step=1)
    log.write(_step(1))
    log.close()
    assert not (tmp_path / "tensorboard").exists()
