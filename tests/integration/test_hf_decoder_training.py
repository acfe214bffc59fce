"""Hugging Face decoders (GPT-2 with tied embeddings, Llama with and without) through ``pipetransformer train`` on real
gloo workers: a 2-stage pipeline whose tied weight sits on both stages, and a pipeline that compresses as layers
freeze (the freed worker a replica, the frozen layers served from the cache), each equal to one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from pipetransformer.data.corpus import BYTE_VOCABULARY
from pipetransformer.dp.sync import TOUCHED_ROWS_MIN_ROWS

from hf_decoders import write_decoder
from jobs import assert_close_states, logged_records, optimizer_state, run_job, seen_samples, summary, weights

pytestmark = pytest.mark.slow

RTOL = 2e-4
ATOL = 1e-7
SAVE = ("run.save_model=true", "run.record_samples=true")
SAMPLES = 96
EPOCHS = 3
"""The freeze at step 3, the cache filled in the second epoch and served in the third."""
TWO_STAGES_THEN_ONE_GB = {"gpt2": 0.03, "llama": 0.02}
"""Budgets (measured here) that hold each tiny decoder as 2 stages but not as one, and as one once its embeddings and
2 layers are frozen and cached."""
OWNER = "blocks.0.tokens.weight"
MIRROR = "blocks.5.projection.weight"


def _config(tmp_path: Path, family: str, *, tied: bool, vocabulary: int = BYTE_VOCABULARY) -> str:
    """A config training a tiny ``family`` decoder (saved under ``tmp_path``) on Rotten Tomatoes' text."""
    path = write_decoder(tmp_path / f"{family}-model", family, tied=tied, vocabulary=vocabulary)
    config = {"seed": 0, "run": {"log_every": 1, "progress": False},
              "model": {"kind": "hf_decoder", "path": str(path)},
              "data": {"name": "rotten_tomatoes", "max_length": 32, "max_train_samples": 256, "max_eval_samples": 64,
                       "max_test_samples": 64},
              "train": {"epochs": 1, "batch_size": 32, "lr": 1.0e-3, "eval_batch_size": 64}}
    file = tmp_path / f"{family}.yaml"
    file.write_text(json.dumps(config))
    return str(file)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_pipelined_decoder_with_tied_embeddings_trains_as_one_process(tmp_path: Path, family: str) -> None:
    """The embeddings on stage 0 and the tied output projection on stage 1: the mirror's gradient reaches the owner
    and the owner's update the mirror, so the run is the one process's, and the optimizer holds the weight once."""
    config = _config(tmp_path, family, tied=True)
    reference, piped = tmp_path / "reference", tmp_path / "piped"
    steps = ("train.max_steps=4",)
    run_job(config, reference, *SAVE, *steps)
    run_job(config, piped, *SAVE, *steps, "pipe.enabled=true", "pipe.stages=2", "pipe.micro_batches=4", nproc=2)
    layout = summary(piped)["layout_history"][0]
    assert (layout["stages"], layout["dp_width"]) == (2, 1)
    assert_close_states(weights(piped), weights(reference), RTOL, ATOL)
    assert_close_states(optimizer_state(piped), optimizer_state(reference), RTOL, ATOL)
    trained = load_file(str(piped / "model.safetensors"))
    initial = load_file(str(tmp_path / f"{family}-model" / "model.safetensors"))
    assert (trained[OWNER] == trained[MIRROR]).all()
    assert not any(key.startswith(MIRROR) for key in optimizer_state(piped))
    embeddings = next(t for name, t in initial.items() if name.endswith(("wte.weight", "embed_tokens.weight")))
    assert (trained[OWNER] - embeddings).abs().max() > 0  # the tied weight trained
    assert summary(piped)["test_nll"] == pytest.approx(summary(reference)["test_nll"], rel=RTOL)


@pytest.mark.parametrize(("family", "tied"), [("gpt2", True), ("llama", False)])
def test_a_decoder_pipeline_compresses_into_replicas_served_by_the_cache(tmp_path: Path, family: str,
                                                                         tied: bool) -> None:
    config = _config(tmp_path, family, tied=tied)
    common = (*SAVE, f"data.max_train_samples={SAMPLES}", f"train.epochs={EPOCHS}", "freeze.enabled=true",
              "freeze.policy=schedule", "freeze.interval_unit=steps", "freeze.schedule=[[3,2]]")
    reference, elastic = tmp_path / "reference", tmp_path / "elastic"
    run_job(config, reference, *common)  # the frozen layers computed every step: what the cache must serve
    result = run_job(config, elastic, *common, "cache.enabled=true", "pipe.enabled=true", "dp.enabled=true",
                     f"pipe.device_memory_gb={TWO_STAGES_THEN_ONE_GB[family]}", nproc=2)
    assert ("layout after step 3, 2 layer(s) frozen: 2 stages x 1 replica -> 1 stage x 2 replicas"
            in result.stdout + result.stderr), "the log does not show the pipeline compressing"
    history = summary(elastic)["layout_history"]
    assert [(h["stages"], h["dp_width"]) for h in history] == [(2, 1), (1, 2)]
    assert history[1]["cached_blocks"] == 3
    assert_close_states(weights(elastic), weights(reference), RTOL, ATOL)
    assert_close_states(optimizer_state(elastic), optimizer_state(reference), RTOL, ATOL)
    for epoch, indices in seen_samples(elastic).items():
        assert sorted(indices) == list(range(SAMPLES)), f"epoch {epoch} did not see every window exactly once"
    if tied:
        trained = load_file(str(elastic / "model.safetensors"))
        assert (trained[OWNER] == trained[MIRROR]).all()  # frozen together at step 3


def test_replicas_of_a_tied_decoder_train_as_one_process_and_sum_the_table_whole(tmp_path: Path) -> None:
    """Replicas sum a vocabulary-sized table by the rows their batches touched (``dp.touched_rows_only``), which
    saves bytes for an input embedding only: tied to the output projection every row has a gradient, so gathering
    row indices would add to a whole table's bytes. The tied table is summed whole, and the replicas train as one
    process."""
    config = _config(tmp_path, "gpt2", tied=True, vocabulary=TOUCHED_ROWS_MIN_ROWS)
    reference, replicas = tmp_path / "reference", tmp_path / "replicas"
    steps = ("train.max_steps=3",)
    run_job(config, reference, *SAVE, *steps)
    run_job(config, replicas, *SAVE, *steps, "pipe.enabled=true", "dp.enabled=true", nproc=2)
    layout = summary(replicas)["layout_history"][0]
    assert (layout["stages"], layout["dp_width"]) == (1, 2)
    trained = weights(replicas)
    assert_close_states(trained, weights(reference), RTOL, ATOL)
    whole = sum(t.numel() * t.element_size() for name, t in trained.items() if name != MIRROR)
    assert [step["allreduce_bytes"] for step in logged_records(replicas, "step")] == [whole] * 3


def test_a_pipelined_tied_decoder_stopped_mid_epoch_resumes_exactly(tmp_path: Path) -> None:
    """The checkpoint of a 2-stage tied GPT-2 holds the mirror with the weights and the owner's optimizer state only;
    stopped at step 3 of 8 and resumed, the run ends as one that never stopped."""
    config = _config(tmp_path, "gpt2", tied=True)
    piped = (*SAVE, "pipe.enabled=true", "pipe.stages=2", "pipe.micro_batches=2", "checkpoint.every_steps=1")
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    run_job(config, reference, *piped, nproc=2)
    run_job(config, stopped, *piped, "train.max_steps=3", nproc=2)
    run_job(config, stopped, *piped, nproc=2, extra_args=("--resume",))
    assert summary(stopped)["steps"] == summary(reference)["steps"] == 8
    assert_close_states(weights(stopped), weights(reference), 0.0, 0.0)
    assert optimizer_state(stopped).keys() == optimizer_state(reference).keys()
    assert_close_states(optimizer_state(stopped), optimizer_state(reference), 0.0, 0.0)
