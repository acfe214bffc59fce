"""The lever planner (more stages, recomputation, bf16 under a memory budget) and whole-run predictions."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from pipetransformer.cli import main
from pipetransformer.dp.sync import DEFAULT_BUCKET_BYTES
from pipetransformer.pipe.cost import BlockCost, Precision
from pipetransformer.pipe.partition import PartitionError
from pipetransformer.plan.cluster import PRESETS, cluster_from_mapping
from pipetransformer.plan.levers import GRADIENT_BUCKET_BYTES, LeverSettings, choose_levers, recompute_set
from pipetransformer.plan.runplan import (
    BatchPolicy,
    FreezePoint,
    TimelineError,
    geometric_timeline,
    plan_run,
    timeline_from_summary,
)

ROOT = Path(__file__).resolve().parents[2]
MB = 10**6
REPLICA_BATCH = 8
LAYERS = 4
# Layers save 1 MB a sample but pass on 0.1 MB: recomputing one keeps 0.1 MB and rebuilds 1 MB for one
# micro-batch during its backward.
EMBEDDINGS = BlockCost(forward_s=1e-4, backward_s=2e-4, output_bytes=MB // 10, param_bytes=1000,
                       activation_bytes=MB // 10)
LAYER = BlockCost(forward_s=1e-3, backward_s=2e-3, output_bytes=MB // 10, param_bytes=1000, activation_bytes=MB)
HEAD = BlockCost(forward_s=1e-5, backward_s=2e-5, output_bytes=8, param_bytes=1000, activation_bytes=MB // 10)
COSTS = [EMBEDDINGS, *[LAYER] * LAYERS, HEAD]
# One stage holds a replica's 8 samples x 4.2 MB = 33.6 MB: over. Recomputing 2 layers: 8 x 2.4 MB + the
# 8 MB one layer rebuilds = 27.2 MB. Two stages (GPipe, the whole batch in flight) hold 8 x 2.1 MB each.
BUDGET = 30 * MB
MICRO_BATCH_OVERHEAD_MS = 5.0
"""Makes pipelining this small model costly, so one stage with recomputation is the faster fit."""


def two_devices(**changes: object) -> object:
    fields = {**PRESETS["a100x8"], "name": "pair", "nodes": 1, "devices_per_node": 2,
              "micro_batch_overhead_ms": MICRO_BATCH_OVERHEAD_MS, **changes}
    return cluster_from_mapping(fields)


def choose(frozen_blocks: int = 0, cluster: object = None, costs: dict[Precision, list[BlockCost] | None] | None = None,
           **settings: object) -> object:
    return choose_levers(costs or {Precision.FP32: COSTS}, cluster or two_devices(), frozen_blocks=frozen_blocks,
                         cached_blocks=frozen_blocks, replica_batch=lambda replicas: REPLICA_BATCH,
                         settings=LeverSettings(memory_budget_bytes=BUDGET, **settings))  # type: ignore[arg-type]


def test_recomputation_beats_a_second_stage_and_is_dropped_after_a_freeze() -> None:
    choice = choose(recompute=True)
    assert (choice.chosen.stages, choice.chosen.replicas) == (1, 2)
    assert choice.chosen.recomputed == (2, 4), "2 of the 4 layers, spread evenly"
    assert choice.chosen.peak_memory_bytes <= BUDGET
    pipeline = next(c for c in choice.rejected if c.stages == 2)
    assert pipeline.recomputed == () and pipeline.reason.startswith("slower")
    assert pipeline.samples_per_s < choice.chosen.samples_per_s

    without = choose(recompute=False)
    assert without.chosen.stages == 2, "without the lever, only a second stage makes it fit"
    assert next(c for c in without.rejected if c.stages == 1).reason.startswith("does not fit: needs")

    # embeddings and the first 2 layers frozen and cached: one stage fits as it is
    after = choose(frozen_blocks=3, recompute=True)
    assert (after.chosen.stages, after.chosen.recomputed) == (1, ())


def test_bf16_where_the_device_has_it() -> None:
    bf16 = [BlockCost(c.forward_s / 4, c.backward_s / 4, c.output_bytes // 2, c.param_bytes, c.activation_bytes // 2)
            for c in COSTS]
    with_bf16 = choose(costs={Precision.FP32: COSTS, Precision.BF16: bf16},
                       precisions=(Precision.FP32, Precision.BF16), recompute=True)
    assert (with_bf16.chosen.precision, with_bf16.chosen.stages, with_bf16.chosen.recomputed) == \
        (Precision.BF16, 1, ())
    lacking = choose(costs={Precision.FP32: COSTS, Precision.BF16: None}, precisions=(Precision.FP32, Precision.BF16),
                     recompute=True)
    reasons = [c.reason for c in lacking.rejected if c.precision is Precision.BF16]
    assert reasons == ["A100-SXM4-80GB has no bf16"], "one entry, not one per stage count"


def test_nothing_fits_is_one_line() -> None:
    with pytest.raises(PartitionError) as error:
        choose_levers({Precision.FP32: COSTS}, two_devices(), frozen_blocks=0, cached_blocks=0,
                      replica_batch=lambda r: 1000, settings=LeverSettings(memory_budget_bytes=BUDGET))
    message = str(error.value)
    assert "\n" not in message and "nothing fits" in message and "does not fit" in message


def test_fixed_settings_pin_the_layout() -> None:
    pinned = choose(stage_counts=(2,), micro_batches=4)
    assert (pinned.chosen.stages, pinned.chosen.micro_batches) == (2, 4)
    assert pinned.chosen.simulation.bubble_fraction > 0


def test_recompute_set_spreads_evenly() -> None:
    assert recompute_set([1, 2, 3, 4, 5, 6], 2) == (2, 5)
    assert recompute_set([1, 2, 3], 3) == (1, 2, 3)
    assert recompute_set([1, 2, 3], 0) == ()


def test_bucket_size_is_the_trainers() -> None:
    assert GRADIENT_BUCKET_BYTES == DEFAULT_BUCKET_BYTES


# --- whole runs -------------------------------------------------------------------------------


def test_geometric_timeline_follows_the_policy() -> None:
    points = geometric_timeline(12, alpha=1 / 3, max_fraction=0.84, epochs=10, every_epochs=1)
    assert points == [FreezePoint(0.0, 0), FreezePoint(0.1, 4), FreezePoint(0.2, 7), FreezePoint(0.3, 8),
                      FreezePoint(0.4, 10)]
    assert geometric_timeline(12, alpha=1 / 3, max_fraction=0.84, epochs=2, every_epochs=0.5)[1] == \
        FreezePoint(0.25, 4)
    with pytest.raises(TimelineError, match="> 0"):
        geometric_timeline(12, alpha=0.5, max_fraction=1.0, epochs=0, every_epochs=1)


def test_timeline_from_a_runs_summary() -> None:
    summary = {"steps": 200, "freeze_decisions": [{"step": 50, "frozen": [0, 1]}, {"step": 100, "frozen": [0, 1, 3]},
                                                  {"step": 150, "frozen": [0, 1, 2, 3]}]}
    assert timeline_from_summary(summary) == [FreezePoint(0.0, 0), FreezePoint(0.25, 2), FreezePoint(0.75, 4)]
    with pytest.raises(TimelineError, match="finished run"):
        timeline_from_summary({"freeze_decisions": []})


def run(timeline: list[FreezePoint], epochs: float = 4, cache: bool = True) -> object:
    settings = LeverSettings(memory_budget_bytes=BUDGET, recompute=True)
    return plan_run({Precision.FP32: COSTS}, two_devices(), num_layers=LAYERS, timeline=timeline, epochs=epochs,
                    batch=BatchPolicy(2 * REPLICA_BATCH, per_pipeline=REPLICA_BATCH), settings=settings,
                    baseline_settings=LeverSettings(memory_budget_bytes=BUDGET), cache=cache)


def test_a_run_without_freezing_is_the_baseline_plus_its_levers() -> None:
    plan = run([FreezePoint(0.0, 0)])
    assert len(plan.phases) == 1
    assert plan.speedup == pytest.approx(plan.phases[0].samples_per_s / plan.baseline.chosen.samples_per_s)
    assert plan.baseline.chosen.stages == 2 and plan.phases[0].choice.chosen.stages == 1


def test_freezing_phases_fill_the_cache_for_an_epoch() -> None:
    plan = run([FreezePoint(0.0, 0), FreezePoint(0.5, 2)], epochs=4)
    spans = [(p.start, p.end, p.frozen_layers, p.cached_blocks, p.filling) for p in plan.phases]
    assert spans == [(0.0, 0.5, 0, 0, False), (0.5, 0.75, 2, 0, True), (0.75, 1.0, 2, 3, False)]
    assert plan.phases[2].samples_per_s > plan.phases[1].samples_per_s > plan.phases[0].samples_per_s
    assert plan.speedup > run([FreezePoint(0.0, 0)]).speedup
    uncached = run([FreezePoint(0.0, 0), FreezePoint(0.5, 2)], cache=False)
    assert [p.cached_blocks for p in uncached.phases] == [0, 0] and uncached.speedup < plan.speedup
    with pytest.raises(TimelineError, match="never thaw"):
        run([FreezePoint(0.0, 2), FreezePoint(0.5, 1)])


def test_a_baseline_that_fits_nowhere_is_named() -> None:
    with pytest.raises(PartitionError, match=r"static baseline \(fp32, no recomputation\) fits nowhere") as error:
        plan_run({Precision.FP32: COSTS}, two_devices(), num_layers=LAYERS, timeline=[FreezePoint(0.0, 0)], epochs=1,
                 batch=BatchPolicy(0, per_pipeline=REPLICA_BATCH),
                 settings=LeverSettings(memory_budget_bytes=BUDGET, recompute=True),
                 baseline_settings=LeverSettings(memory_budget_bytes=BUDGET, stage_counts=(1,)))
    assert "\n" not in str(error.value) and "allow recomputation" not in str(error.value)


def test_decisions_within_an_epoch_meet_entries_from_before_the_last_one() -> None:
    """A sample's entry is from its visit one epoch ago: with decisions every half epoch it lags two freezes."""
    timeline = [FreezePoint(0.0, 0), FreezePoint(0.25, 2), FreezePoint(0.5, 3)]

    def spans(advance_cache: bool = True) -> list[tuple[float, float, int, int, bool]]:
        plan = plan_run({Precision.FP32: COSTS}, two_devices(), num_layers=LAYERS, timeline=timeline, epochs=2,
                        batch=BatchPolicy(0, per_pipeline=REPLICA_BATCH),
                        settings=LeverSettings(memory_budget_bytes=BUDGET, recompute=True),
                        baseline_settings=LeverSettings(memory_budget_bytes=BUDGET), advance_cache=advance_cache)
        return [(p.start, p.end, p.frozen_layers, p.cached_blocks, p.filling) for p in plan.phases]

    assert spans() == [(0.0, 0.25, 0, 0, False), (0.25, 0.5, 2, 0, True), (0.5, 0.75, 3, 0, True),
                       (0.75, 1.0, 3, 3, True)]
    assert spans(advance_cache=False) == [(0.0, 0.25, 0, 0, False), (0.25, 0.5, 2, 0, True),
                                          (0.5, 1.0, 3, 0, True)], "stale entries are rebuilt from the input"


def test_batch_policies() -> None:
    assert BatchPolicy(64).replica_batch(4, initial_replicas=2) == 16
    assert BatchPolicy(64, keep_per_pipeline=True).replica_batch(4, initial_replicas=2) == 32
    assert BatchPolicy(64, per_pipeline=10).replica_batch(4, initial_replicas=None) == 10


# --- the command --------------------------------------------------------------------------------


def test_plan_cluster_json_and_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plot = tmp_path / "plan.png"
    assert main(["plan", "--cluster", "paper", "--model", "vit-b16", "--epochs", "4", "--json",
                 "--set", "train.batch_size=256", "--plot", str(plot)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cluster"] == "paper" and report["speedup"] > 1
    assert [phase["frozen_layers"] for phase in report["phases"]][0] == 0
    assert all(phase["alternatives"] for phase in report["phases"])
    assert any("no bf16" in alt["rejected"] for alt in report["phases"][0]["alternatives"])
    assert plot.stat().st_size > 0


def test_plan_cluster_follows_a_finished_runs_freezes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    summary = {"steps": 100,
               "freeze_decisions": [{"step": 40, "frozen": [0, 1, 2]}, {"step": 70, "frozen": [0, 1, 2, 3]}]}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert main(["plan", "--cluster", "a100x8", "--model", "minilm", "--freeze", str(tmp_path), "--epochs", "10",
                 "--json"]) == 0
    phases = json.loads(capsys.readouterr().out)["phases"]
    assert [(p["start"], p["frozen_layers"]) for p in phases][:3] == [(0.0, 0), (0.4, 3), (0.5, 3)]
    assert phases[-1]["frozen_layers"] == 4 and phases[-1]["end"] == 1.0


def test_plan_cluster_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--cluster", "h100x8", "--model", "bert-large", "--epochs", "3", "--timeline",
                 "--set", "train.batch_size=64"]) == 0
    out = capsys.readouterr().out
    assert "static Pipe+DDP baseline" in out and "rejected alternatives:" in out
    assert re.search(r"predicted speed-up over the baseline: \d+\.\d\dx", out)
    assert "stage 0  |" in out


def test_plan_local_profiles_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    """tiny_vit sets pipe.profile: false, so 'profiling' is the analytic estimate and takes no time."""
    assert main(["plan", str(ROOT / "configs" / "tiny_vit.yaml"), "--cluster", "local", "--nproc-per-node", "2",
                 "--epochs", "2", "--json", "--set", "freeze.enabled=true", "--set", "cache.enabled=true"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cluster"] == "local" and math.isfinite(report["speedup"])


@pytest.mark.parametrize(("args", "names"), [
    (["--cluster", "paper", "--model", "vit-b16", "--levers", "stages,magic"], ("--levers", "'magic'")),
    (["--cluster", "nowhere.yaml", "--model", "vit-b16"], ("neither a preset",)),
    (["--cluster", "paper", "--model", "gpt-9"], ("neither a built-in model",)),
    (["--cluster", "paper"], ("plan needs a config",)),
    (["--cluster", "paper", "--model", "vit-b16", "--freeze", "nowhere"], ("summary.json",)),
])
def test_plan_cluster_errors_are_one_line(capsys: pytest.CaptureFixture[str], args: list[str],
                                          names: tuple[str, ...]) -> None:
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert all(name in err[0] for name in names), err[0]
