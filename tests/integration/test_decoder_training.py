"""The built-in causal decoder through ``pipetransformer train`` on real gloo workers: a 2-stage pipeline, and a
pipeline that compresses as layers freeze, the freed worker joining as a replica and the frozen layers' outputs served
from the cache, each equal to one process training the same samples."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import assert_close_states, optimizer_state, run_job, seen_samples, summary, weights

pytestmark = pytest.mark.slow

DECODER = "tiny_decoder.yaml"
RTOL = 2e-4
ATOL = 1e-7
SAVE = ("run.save_model=true", "run.record_samples=true")
TWO_STAGES_THEN_ONE_GB = 0.02
"""tiny_decoder holds as 2 stages but not as one, and as one once its embeddings and 2 layers are frozen and cached."""
SAMPLES = 96
EPOCHS = 3
"""The freeze at the first epoch's end, the cache filled in the second and served in the third."""


def test_a_pipelined_decoder_trains_as_one_process(tmp_path: Path) -> None:
    steps = ("train.max_steps=4",)
    reference, piped = tmp_path / "reference", tmp_path / "piped"
    run_job(DECODER, reference, *SAVE, *steps)
    run_job(DECODER, piped, *SAVE, *steps, "pipe.enabled=true", "pipe.stages=2", "pipe.micro_batches=4", nproc=2)
    layout = summary(piped)["layout_history"][0]
    assert (layout["stages"], layout["dp_width"], layout["micro_batches"]) == (2, 1, 4)
    assert_close_states(weights(piped), weights(reference), RTOL, ATOL)
    assert_close_states(optimizer_state(piped), optimizer_state(reference), RTOL, ATOL)
    assert summary(piped)["test_nll"] == pytest.approx(summary(reference)["test_nll"], rel=RTOL)
    prompts = tmp_path / "prompts.csv"
    prompts.write_text('text\n"The film is"\n"I loved"\n', encoding="utf-8")
    out = tmp_path / "continued.csv"
    done = subprocess.run([sys.executable, "-m", "pipetransformer.cli", "predict", str(piped), "--input", str(prompts),
                           "--output", str(out), "--max-new-tokens", "8"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(out.open()))
    assert [row["prompt"] for row in rows] == ["The film is", "I loved"]
    assert all(len(row["continuation"].encode()) <= 8 * 3 for row in rows)  # 8 bytes, a U+FFFD (3 bytes) each at most


def test_a_decoder_pipeline_compresses_into_replicas_served_by_the_cache(tmp_path: Path) -> None:
    common = (*SAVE, f"data.max_train_samples={SAMPLES}", f"train.epochs={EPOCHS}", "freeze.enabled=true",
              "freeze.policy=schedule", "freeze.interval_unit=steps", "freeze.schedule=[[3,2]]")
    reference, elastic = tmp_path / "reference", tmp_path / "elastic"
    run_job(DECODER, reference, *common)  # the frozen layers computed every step: what the cache must serve
    result = run_job(DECODER, elastic, *common, "cache.enabled=true", "pipe.enabled=true", "dp.enabled=true",
                     f"pipe.device_memory_gb={TWO_STAGES_THEN_ONE_GB}", nproc=2)
    assert ("layout after step 3, 2 layer(s) frozen: 2 stages x 1 replica -> 1 stage x 2 replicas"
            in result.stdout + result.stderr), "the log does not show the pipeline compressing"
    history = summary(elastic)["layout_history"]
    assert [(h["stages"], h["dp_width"]) for h in history] == [(2, 1), (1, 2)]
    assert history[1]["step"] == 3 and history[1]["cached_blocks"] == 3
    assert_close_states(weights(elastic), weights(reference), RTOL, ATOL)
    assert_close_states(optimizer_state(elastic), optimizer_state(reference), RTOL, ATOL)
    for epoch, indices in seen_samples(elastic).items():
        assert sorted(indices) == list(range(SAMPLES)), f"epoch {epoch} did not see every window exactly once"
    cached = [json.loads(line) for line in (elastic / "metrics.jsonl").read_text().splitlines()]
    hits = [r["cache_hit_rate"] for r in cached if r.get("event") == "step" and r.get("cache_hit_rate") is not None]
    # the run's hit rate so far: nothing before the third epoch (filled in the second), every lookup in it a hit
    assert hits[:3] == [0.0] * 3 and hits[-1] == pytest.approx(0.5), hits


def _arithmetic(path: Path, rows: int) -> Path:
    """Instruction data whose prompts and responses differ in length: padded, trimmed and micro-batched rows."""
    lines = ["question,answer"] + [f'"Q: what is {a} plus {a * 7 % 13}? A:", {a + a * 7 % 13}' for a in range(rows)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_a_pipelined_decoder_on_instruction_data_trains_as_one_process(tmp_path: Path) -> None:
    data = ("data.name=text_csv", f"data.path={_arithmetic(tmp_path / 'qa.csv', 160)}", "data.text_column=question",
            "data.response_column=answer", "data.max_length=40", "data.max_train_samples=null",
            "data.max_eval_samples=null", "data.max_test_samples=null", "train.max_steps=3")
    reference, piped = tmp_path / "reference", tmp_path / "piped"
    run_job(DECODER, reference, *SAVE, *data)
    run_job(DECODER, piped, *SAVE, *data, "pipe.enabled=true", "pipe.stages=2", "pipe.micro_batches=4", nproc=2)
    assert_close_states(weights(piped), weights(reference), RTOL, ATOL)
    assert_close_states(optimizer_state(piped), optimizer_state(reference), RTOL, ATOL)
    assert summary(piped)["test_nll"] == pytest.approx(summary(reference)["test_nll"], rel=RTOL)
