"""Whole training jobs on real gloo workers equal a single-process run of the same steps.

Every comparison runs the same config, seed, samples and freeze decisions in one process without any
pipeline or elastic machinery; only the float rounding of sums split across ranks may differ.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from jobs import assert_close_states, logged_records, optimizer_state, run_job, seen_samples, summary, weights

pytestmark = pytest.mark.slow

RTOL = 2e-4
ATOL = 1e-7
VIT = "tiny_vit.yaml"
TEXT = "tiny_text.yaml"
SAVE = ("run.save_model=true", "run.record_samples=true")
BF16_LOSS_RTOL = 2e-2  # a bf16 forward's step losses against fp32 over 8 steps of the tiny ViT


GRADIENT_FREEZE = ("freeze.enabled=true", "freeze.policy=gradient", "freeze.interval=1", "freeze.interval_unit=steps",
                   "freeze.alpha=0.5")  # one-step windows: the 8-step run freezes (at steps 2, 6, 7)


def test_data_parallel_matches_single_process(tmp_path: Path) -> None:
    """Plain data parallelism with the gradient-norm freeze policy: every rank takes the same decisions
    (from all-reduced norms) as the single process, and replicas stay bit-identical."""
    reference = tmp_path / "reference"
    run_job(VIT, reference, *SAVE, *GRADIENT_FREEZE, "train.max_steps=8")
    parallel = tmp_path / "parallel"
    result = run_job(VIT, parallel, *SAVE, *GRADIENT_FREEZE, "train.max_steps=8", nproc=2)
    evaluations = len(summary(parallel)["eval_history"])
    assert result.stderr.count("validation accuracy") == evaluations, "an evaluation was logged by every rank"
    assert_close_states(weights(parallel), weights(reference), RTOL, ATOL)
    assert_close_states(optimizer_state(parallel), optimizer_state(reference), RTOL, ATOL)
    fingerprints = summary(parallel)["rank_fingerprints"]
    assert fingerprints[0] == fingerprints[1], "replicas diverged"
    before, peak = summary(parallel)["rss_before_model_bytes"], summary(parallel)["peak_rss_bytes"]
    assert len(before) == len(peak) == 2 and all(0 < b <= p for b, p in zip(before, peak, strict=True))
    assert summary(parallel)["layout_history"][0]["dp_width"] == 2
    decisions = [d["frozen"] for d in summary(parallel)["freeze_decisions"]]
    assert decisions, "the gradient policy froze nothing"
    assert decisions == [d["frozen"] for d in summary(reference)["freeze_decisions"]]
    assert summary(parallel)["freeze_outcome"].startswith(f"{len(decisions[-1])} of ")
    # the test split's per-sample accuracy, gathered from both ranks' shards into the split's order
    shards, whole = (json.loads((run / "test_samples.json").read_text())["final"] for run in (parallel, reference))
    assert shards == whole and sum(shards) / len(shards) == summary(parallel)["test_accuracy"]


def test_vocabulary_summed_by_touched_rows_trains_as_summed_whole(tmp_path: Path) -> None:
    """tiny_text's 30,522-row token table on 2 replicas: all-reduced by the rows the batches touched, the run is
    the run with the table all-reduced whole (same weights and Adam state), for a fraction of the bytes."""
    runs = {}
    for touched in (True, False):
        runs[touched] = tmp_path / f"touched-{touched}"
        run_job(TEXT, runs[touched], *SAVE, "train.max_steps=4", f"dp.touched_rows_only={str(touched).lower()}",
                nproc=2)
    assert_close_states(weights(runs[True]), weights(runs[False]), RTOL, ATOL)
    assert_close_states(optimizer_state(runs[True]), optimizer_state(runs[False]), RTOL, ATOL)
    table_bytes = 30_522 * 32 * 4
    for by_rows, whole in zip(logged_records(runs[True], "step"), logged_records(runs[False], "step"), strict=True):
        assert by_rows["loss"] == pytest.approx(whole["loss"], rel=RTOL)
        assert whole["allreduce_bytes"] - by_rows["allreduce_bytes"] > 0.9 * table_bytes


def test_coherence_signals_of_a_pipeline_and_of_replicas_equal_one_process(tmp_path: Path) -> None:
    """The freezer's inputs, g_t . g_{t-1} and the descent per layer (every step logged computes both), assembled in
    the control vector from the stages that hold the layers (2-stage pipeline) or from the replica that measures each
    (data parallelism: a share each), equal one process's."""
    logged = ("train.max_steps=5", "run.log_every=1", "freeze.enabled=true", "freeze.policy=coherence")
    reference = tmp_path / "reference"
    run_job(TEXT, reference, *logged)
    piped, replicas = tmp_path / "piped", tmp_path / "replicas"
    run_job(TEXT, piped, *logged, "pipe.enabled=true", "pipe.stages=2", "pipe.micro_batches=2", nproc=2)
    run_job(TEXT, replicas, *logged, nproc=2)
    for signal in ("layer_grad_dots", "layer_descents"):
        expected = [r[signal] for r in logged_records(reference, "step")]
        assert expected[0] == [None] * 4 and all(v is not None for row in expected[1:] for v in row), signal
        for run in (piped, replicas):
            got = [r[signal] for r in logged_records(run, "step")]
            assert got[0] == [None] * 4, signal
            for got_row, want_row in zip(got[1:], expected[1:], strict=True):
                assert got_row == pytest.approx(want_row, rel=1e-3, abs=1e-9), signal
    # 5 steps are no window of the default cadence: the run says so instead of freezing nothing silently
    assert "nothing froze in 0 decision windows: the coherence test needs 4 (two to learn" in summary(reference)["freeze_outcome"]


PIPELINE_STEPS = ("train.max_steps=4",)


@pytest.fixture(scope="module")
def one_process_text_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The single-process run both pipeline schedules must reproduce (run once for the two)."""
    reference = tmp_path_factory.mktemp("pipeline") / "reference"
    run_job(TEXT, reference, *SAVE, *PIPELINE_STEPS)
    return reference


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_matches_single_process(tmp_path: Path, one_process_text_run: Path, schedule: str) -> None:
    reference = one_process_text_run
    piped = tmp_path / "piped"
    run_job(TEXT, piped, *SAVE, *PIPELINE_STEPS, "pipe.enabled=true", "pipe.stages=2", "pipe.micro_batches=4",
            f"pipe.schedule={schedule}", nproc=2)
    layout = summary(piped)["layout_history"][0]
    assert (layout["stages"], layout["dp_width"], layout["micro_batches"]) == (2, 1, 4)
    assert_close_states(weights(piped), weights(reference), RTOL, ATOL)
    assert_close_states(optimizer_state(piped), optimizer_state(reference), RTOL, ATOL)


def _elastic(tmp_path: Path, nproc: int, budget_gb: float, schedule: str) -> Path:
    """Pipeline compressed by freezing, freed workers turned into replicas, cache on; vs one process. Layer-wise
    learning-rate decay is on, so each rebuilt optimizer must keep every block's own rate."""
    common = (*SAVE, "data.max_train_samples=96", "freeze.enabled=true", "freeze.policy=schedule",
              "freeze.interval_unit=steps", f"freeze.schedule={schedule}", "cache.enabled=true",
              "train.layer_lr_decay=0.8")
    reference = tmp_path / "reference"
    run_job(VIT, reference, *common)
    elastic = tmp_path / "elastic"
    run_job(VIT, elastic, *common, "pipe.enabled=true", "dp.enabled=true", f"pipe.device_memory_gb={budget_gb}",
            nproc=nproc)
    assert_close_states(weights(elastic), weights(reference), RTOL, ATOL)
    assert_close_states(optimizer_state(elastic), optimizer_state(reference), RTOL, ATOL)
    for epoch, indices in seen_samples(elastic).items():
        assert sorted(indices) == list(range(96)), f"epoch {epoch} did not see every sample exactly once"
    assert summary(elastic)["steps"] == summary(reference)["steps"] == 12
    return elastic


def test_elastic_two_workers_pipeline_to_replicas(tmp_path: Path) -> None:
    elastic = _elastic(tmp_path, 2, 0.008, "[[3,2]]")
    history = summary(elastic)["layout_history"]
    assert [(h["stages"], h["dp_width"]) for h in history] == [(2, 1), (1, 2)]
    assert history[1]["step"] == 3 and history[1]["cached_blocks"] == 3


def test_elastic_four_workers_4x1_2x2_1x4(tmp_path: Path) -> None:
    elastic = _elastic(tmp_path, 4, 0.004, "[[3,2],[6,3]]")
    history = summary(elastic)["layout_history"]
    assert [(h["stages"], h["dp_width"]) for h in history] == [(4, 1), (2, 2), (1, 4)]
    fingerprints = summary(elastic)["rank_fingerprints"]
    assert len({tuple(f) for f in fingerprints}) == 1, "the four replicas diverged"


def test_two_by_two_1f1b_repartitions_frozen_blocks(tmp_path: Path) -> None:
    """4 workers as 2 stages x 2 replicas under 1F1B; a freeze re-balances the stages mid-training."""
    common = (*SAVE, "data.max_train_samples=96", "train.max_steps=5", "freeze.enabled=true",
              "freeze.policy=schedule", "freeze.interval_unit=steps", "freeze.schedule=[[2,2]]")
    reference = tmp_path / "reference"
    run_job(VIT, reference, *common)
    piped = tmp_path / "piped"
    run_job(VIT, piped, *common, "pipe.enabled=true", "pipe.stages=2", "pipe.schedule=1f1b", "pipe.micro_batches=2",
            nproc=4)
    history = summary(piped)["layout_history"]
    assert [(h["stages"], h["dp_width"]) for h in history] == [(2, 2), (2, 2)]
    assert history[0]["bounds"] != history[1]["bounds"], "the freeze did not re-balance the stages"
    assert_close_states(weights(piped), weights(reference), RTOL, ATOL)
    assert_close_states(optimizer_state(piped), optimizer_state(reference), RTOL, ATOL)


def test_keep_per_pipeline_batch_policy_grows_batch_and_lr(tmp_path: Path) -> None:
    run_job(VIT, tmp_path, "train.max_steps=4", "pipe.enabled=true", "dp.enabled=true", "pipe.device_memory_gb=0.008",
            "dp.batch_policy=keep_per_pipeline", "train.warmup_fraction=0.0", "train.lr_schedule=constant",
            "freeze.enabled=true", "freeze.policy=schedule", "freeze.interval_unit=steps", "freeze.schedule=[[2,3]]",
            "cache.enabled=true", nproc=2)
    steps = logged_records(tmp_path, "step")
    assert [s["dp_width"] for s in steps] == [1, 1, 2, 2]
    assert [s["global_batch"] for s in steps] == [16, 16, 32, 32]
    assert steps[2]["lr"] == pytest.approx(2 * steps[0]["lr"]), "linear scaling rule: lr grows with the width"


def test_layer_lr_decay_scales_each_blocks_update(tmp_path: Path) -> None:
    """One SGD step at decay d moves block i of n by d^(n-1-i) of what it moves at decay 1."""
    # A large rate, so even the embeddings' update (0.5^7 of it) stands far above the weights' float rounding.
    plain_sgd = ("train.max_steps=1", "train.optimizer=sgd", "train.momentum=0.0", "train.weight_decay=0.0",
                 "train.warmup_fraction=0.0", "train.lr_schedule=constant", "train.grad_clip=null", *SAVE)
    variants = {"initial": ("train.lr=1e-30",), "full": ("train.lr=10",),
                "decayed": ("train.lr=10", "train.layer_lr_decay=0.5")}
    runs = {}
    for name, overrides in variants.items():
        run_job(VIT, tmp_path / name, *plain_sgd, *overrides)
        runs[name] = weights(tmp_path / name)
    num_blocks = 1 + max(int(name.split(".")[1]) for name in runs["initial"])
    for name, initial in runs["initial"].items():
        block = int(name.split(".")[1])
        expected = (runs["full"][name] - initial) * 0.5 ** (num_blocks - 1 - block)
        torch.testing.assert_close(runs["decayed"][name] - initial, expected, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("samples", [45, 33], ids=["tail-13-prime", "tail-1-below-stages"])
def test_1f1b_epoch_tail_of_an_odd_size(tmp_path: Path, samples: int) -> None:
    """An epoch of 32 + a tail of 13 (prime, above the 8 micro-batches: 13 of one sample each) or of 1 (fewer
    samples than stages: that step runs GPipe) under 1F1B trains as one process does, and does not crash."""
    common = (*SAVE, f"data.max_train_samples={samples}", "train.epochs=1")
    reference = tmp_path / "reference"
    run_job(TEXT, reference, *common)
    piped = tmp_path / "piped"
    run_job(TEXT, piped, *common, "pipe.enabled=true", "pipe.stages=2", "pipe.schedule=1f1b", "pipe.micro_batches=8",
            nproc=2)
    assert summary(piped)["steps"] == 2 and summary(piped)["train_samples"] == samples
    assert_close_states(weights(piped), weights(reference), RTOL, ATOL)
    assert_close_states(optimizer_state(piped), optimizer_state(reference), RTOL, ATOL)


def test_lr_schedule_and_progress_span_the_samples_when_the_batch_grows_and_tails_drop(tmp_path: Path) -> None:
    """keep_per_pipeline doubles the global batch at the width change (16 -> 32) and drop_last drops 8 samples of
    each epoch of 200: the linear schedule still ends with the data, and the progress bar reaches its total."""
    samples, epochs, batch, warmup = 200, 2, 16, 0.06
    result = run_job(VIT, tmp_path, f"data.max_train_samples={samples}", f"train.epochs={epochs}",
                     f"train.batch_size={batch}", "train.drop_last=true", f"train.warmup_fraction={warmup}",
                     "train.lr_schedule=linear", "run.progress=true", "pipe.enabled=true", "dp.enabled=true",
                     "pipe.device_memory_gb=0.008", "dp.batch_policy=keep_per_pipeline", "freeze.enabled=true",
                     "freeze.policy=schedule", "freeze.interval_unit=steps", "freeze.schedule=[[2,3]]", nproc=2)
    steps = logged_records(tmp_path, "step")
    assert [s["global_batch"] for s in steps] == [16, 16] + [32] * 5 + [32] * 6
    total = samples * epochs
    warmup_samples = int(warmup * total)
    peak = 1e-3 * 2  # tiny_vit's train.lr, linearly scaled at width 2
    # The last step trains samples 360..392 of 400 (its epoch's 8 last ones dropped): one batch and a tail from the end.
    assert steps[-1]["lr"] == pytest.approx(peak * (1 - (total - 40 - warmup_samples) / (total - warmup_samples)))
    assert f"{total}/{total}" in result.stderr, "the progress bar (in samples) did not reach its total"


def test_recomputation_chosen_for_a_budget_trains_as_without_it_and_bf16_close_to_it(tmp_path: Path) -> None:
    """Under a budget one stage fits only by recomputing (a second stage would also fit): the planner picks
    recomputation, drops it once two layers freeze, and the run equals the same layout without a budget
    exactly. The same run in bf16 stays within a stated tolerance of the fp32 losses."""
    common = (*SAVE, "train.max_steps=8", "pipe.enabled=true", "dp.enabled=true", "cache.enabled=true",
              "freeze.enabled=true", "freeze.policy=schedule", "freeze.interval_unit=steps", "freeze.schedule=[[4,2]]")
    budget = ("pipe.device_memory_gb=0.007", "pipe.recompute=true")
    plain, recomputed, bf16 = tmp_path / "plain", tmp_path / "recomputed", tmp_path / "bf16"
    run_job(VIT, plain, *common, nproc=2)
    run_job(VIT, recomputed, *common, *budget, nproc=2)
    run_job(VIT, bf16, *common, *budget, "train.precision=bf16", nproc=2)
    history = summary(recomputed)["layout_history"]
    assert [(h["stages"], h["dp_width"], h["frozen_layers"]) for h in history] == [(1, 2, 0), (1, 2, 2)]
    assert history[0]["recomputed_blocks"] and history[1]["recomputed_blocks"] == []
    assert all(not h["recomputed_blocks"] for h in summary(plain)["layout_history"])
    losses = [r["loss"] for r in logged_records(plain, "step")]
    assert [r["loss"] for r in logged_records(recomputed, "step")] == losses
    for name, tensor in weights(plain).items():
        assert torch.equal(weights(recomputed)[name], tensor), name
    bf16_losses = [r["loss"] for r in logged_records(bf16, "step")]
    assert bf16_losses != losses and bf16_losses == pytest.approx(losses, rel=BF16_LOSS_RTOL)
