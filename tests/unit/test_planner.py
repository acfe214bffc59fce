"""The layout planner: which memory a stage is checked against, per schedule."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pipetransformer.config import PipeConfig, load_config
from pipetransformer.pipe.cost import BlockCost, Precision
from pipetransformer.pipe.partition import PartitionError, micro_batch_candidates, predict_step_time
from pipetransformer.pipe.planner import (PER_MICROBATCH_OVERHEAD_S, LayoutPlan, plan_layout, plan_request,
                                          step_micro_batches)

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_vit.yaml"
BATCH = 32
# 8 blocks whose activations (1 MB per sample) dwarf their parameters (1 KB): memory grows with the samples held.
# A call costs as much as 2 samples, so small micro-batches are dear.
COSTS = [BlockCost(forward_s=1e-3, backward_s=2e-3, output_bytes=1_000, param_bytes=1_000,
                   activation_bytes=1_000_000, forward_fixed_s=2e-3, backward_fixed_s=4e-3)] * 8
# Between one stage holding its replica's 16 samples (8 blocks x 16 MB) and a 1F1B stage holding 2 micro-batches
# of 4 samples (4 blocks x 8 MB), and below a GPipe stage holding its whole 32 samples (4 blocks x 32 MB).
BUDGET_GB = 0.1


def _plan(schedule: str, micro_batches: str, frozen_blocks: int = 0) -> tuple[int, int]:
    config = load_config(CONFIG, [f"train.batch_size={BATCH}", "pipe.enabled=true", "dp.enabled=true",
                                  f"pipe.device_memory_gb={BUDGET_GB}", f"pipe.schedule={schedule}",
                                  f"pipe.micro_batches={micro_batches}"])
    plan = plan_layout(config.pipe, COSTS, 2, elastic=config.dp.enabled, batch_size=config.train.batch_size,
                       frozen_blocks=frozen_blocks, cached_blocks=0)
    return plan.layout.num_stages, plan.layout.dp_width


def test_1f1b_with_fixed_micro_batches_fits_a_pipeline_where_whole_batches_do_not() -> None:
    assert _plan("1f1b", "8") == (2, 1)
    assert _plan("1f1b", "8", frozen_blocks=3) == (1, 2), "once frozen blocks hold no activations, compress"


@pytest.mark.parametrize("micro_batches", ["8", "auto"])
def test_gpipe_is_checked_for_the_whole_batch(micro_batches: str) -> None:
    """GPipe keeps every micro-batch's activations until backward: the whole batch, whatever the count."""
    with pytest.raises(PartitionError, match="too small"):
        _plan("gpipe", micro_batches)


def test_1f1b_auto_chooses_the_count_with_the_split_so_a_pipeline_fits() -> None:
    """2 micro-batches of 16 in flight hold the whole batch (4 blocks x 32 MB, over the budget); 4 of 8 fit, and
    are faster than more, smaller ones (each pays the blocks' costs per call: 5 beats of 121 ms against 9 of 73)."""
    config = load_config(CONFIG, [f"train.batch_size={BATCH}", "pipe.enabled=true", "dp.enabled=true",
                                  f"pipe.device_memory_gb={BUDGET_GB}", "pipe.schedule=1f1b",
                                  "pipe.micro_batches=auto"])
    plan = plan_layout(config.pipe, COSTS, 2, elastic=True, batch_size=BATCH, frozen_blocks=0, cached_blocks=0)
    assert (plan.layout.num_stages, plan.layout.dp_width, plan.micro_batches) == (2, 1, 4)


# MiniLM's blocks as `pipetransformer plan configs/text_minilm_no_freeze.yaml` profiled them here (per sample, and
# per call): the embeddings hold most parameters (and pay ~19 ms a backward for their table's dense gradient),
# the layers most activations.
MINILM_COSTS = [
    BlockCost(forward_s=0.14e-3, backward_s=0.08e-3, output_bytes=98_800, param_bytes=47_670_000,
              activation_bytes=198_200, forward_fixed_s=0.36e-3, backward_fixed_s=18.6e-3),
    *[BlockCost(forward_s=2.8e-3, backward_s=4.5e-3, output_bytes=98_800, param_bytes=7_100_000,
                activation_bytes=2_360_300, forward_fixed_s=1.1e-3, backward_fixed_s=1.2e-3)] * 6,
    BlockCost(forward_s=1e-5, backward_s=1e-5, output_bytes=8, param_bytes=3_080, activation_bytes=3_300,
              forward_fixed_s=3e-5, backward_fixed_s=4e-5),
]
MINILM_BUDGET_GB = 0.5


def _minilm_plan(micro_batches: str) -> LayoutPlan:
    config = load_config(CONFIG, [f"train.batch_size={BATCH}", "pipe.enabled=true", "pipe.schedule=1f1b",
                                  f"pipe.device_memory_gb={MINILM_BUDGET_GB}", f"pipe.micro_batches={micro_batches}"])
    return plan_layout(config.pipe, MINILM_COSTS, 2, elastic=False, batch_size=BATCH, frozen_blocks=0,
                       cached_blocks=0)


def _predicted_s(plan: LayoutPlan) -> float:
    return predict_step_time(plan.partition, BATCH, plan.micro_batches, PER_MICROBATCH_OVERHEAD_S)


def test_1f1b_auto_is_the_fastest_fixed_count_with_its_own_split() -> None:
    """Checked for 2 micro-batches (the whole batch in flight) only an uneven split fits MiniLM under 0.5 GB; from
    4 on, the even one does. Auto must find the fastest (split, count) pair any fixed count finds, which here is
    also the one measured fastest (benchmarks/planner, micro-batches)."""
    fixed = {m: _minilm_plan(str(m)) for m in micro_batch_candidates(2, BATCH)}
    assert fixed[2].partition.bounds != fixed[4].partition.bounds, "the case needs a split that depends on the count"
    auto = _minilm_plan("auto")
    fastest = min(fixed.values(), key=_predicted_s)
    assert (auto.micro_batches, auto.partition.bounds) == (fastest.micro_batches, fastest.partition.bounds)
    assert _predicted_s(auto) == pytest.approx(min(_predicted_s(plan) for plan in fixed.values()))
    assert (auto.micro_batches, auto.partition.bounds) == (4, [(0, 4), (4, 8)])


@pytest.mark.parametrize("micro_batches", ["1", "auto"])
def test_1f1b_plans_at_least_one_micro_batch_per_stage(micro_batches: str) -> None:
    """Torch's 1F1B refuses fewer micro-batches than stages; a fixed 1, or auto on a prime replica batch (31, no
    divisor from 2 to 8), must not plan that."""
    config = load_config(CONFIG, ["train.batch_size=31", "pipe.enabled=true", "pipe.stages=2", "pipe.schedule=1f1b",
                                  f"pipe.micro_batches={micro_batches}"])
    plan = plan_layout(config.pipe, COSTS, 2, elastic=config.dp.enabled, batch_size=config.train.batch_size,
                       frozen_blocks=0, cached_blocks=0)
    assert plan.layout.num_stages == 2 and plan.micro_batches >= 2


@pytest.mark.parametrize(("rows", "planned", "schedule", "expected"), [
    (32, 8, "1f1b", (8, "1f1b")),    # the planned count when it divides
    (30, 8, "1f1b", (6, "1f1b")),    # else the largest divisor up to it
    (13, 8, "1f1b", (13, "1f1b")),   # a prime tail: smaller micro-batches, never fewer than the stages
    (1, 8, "1f1b", (1, "gpipe")),    # fewer samples than stages: GPipe for this step
    (13, 8, "gpipe", (1, "gpipe")),  # GPipe runs any count
])
def test_each_step_gets_equal_micro_batches_its_schedule_accepts(rows: int, planned: int, schedule: str,
                                                                  expected: tuple[int, str]) -> None:
    assert step_micro_batches(rows, planned, stages=2, schedule=schedule) == expected


# Layers save 1 MB a sample but pass on 0.1 MB, so recomputing one keeps 0.1 MB of its 1 MB.
RECOMPUTE_COSTS = [
    BlockCost(forward_s=1e-4, backward_s=2e-4, output_bytes=100_000, param_bytes=1_000, activation_bytes=100_000),
    *[BlockCost(forward_s=1e-3, backward_s=2e-3, output_bytes=100_000, param_bytes=1_000,
                activation_bytes=1_000_000)] * 4,
    BlockCost(forward_s=1e-5, backward_s=2e-5, output_bytes=8, param_bytes=1_000, activation_bytes=100_000),
]
# 8 a replica on 2 workers: one stage holds 8 x 4.2 MB, over the budget; recomputing 2 layers, 8 x 2.4 MB + the 8 MB
# one layer rebuilds. Two 1F1B stages hold 2 micro-batches of 2 samples x 2.1 MB.
RECOMPUTE_BATCH = 16
RECOMPUTE_BUDGET_GB = 0.03


def _lever_plan(recompute: bool, frozen_blocks: int = 0) -> object:
    config = load_config(CONFIG, [f"train.batch_size={RECOMPUTE_BATCH}", "pipe.enabled=true", "dp.enabled=true",
                                  f"pipe.device_memory_gb={RECOMPUTE_BUDGET_GB}", f"pipe.recompute={recompute}",
                                  "pipe.schedule=1f1b", "pipe.micro_batches=8"])
    return plan_layout(config.pipe, RECOMPUTE_COSTS, 2, elastic=True, batch_size=RECOMPUTE_BATCH,
                       frozen_blocks=frozen_blocks, cached_blocks=frozen_blocks)


def test_pipe_recompute_trades_a_second_stage_for_recomputation_and_drops_it_after_a_freeze() -> None:
    plain = _lever_plan(recompute=False)
    assert (plain.layout.num_stages, plain.recomputed_blocks) == (2, ()), "only a second stage fits without it"
    # Two stages of 8 micro-batches pay 2 x 8 x 20 ms of per-micro-batch overhead on this machine's estimate; the
    # recomputed forwards of two layers cost 16 ms: one stage x 2 replicas wins.
    chosen = _lever_plan(recompute=True)
    assert (chosen.layout.num_stages, chosen.layout.dp_width) == (1, 2)
    assert chosen.recomputed_blocks == (2, 4) and chosen.describe()["recomputed_blocks"] == [2, 4]
    after = _lever_plan(recompute=True, frozen_blocks=3)  # embeddings and 2 layers frozen and cached
    assert (after.layout.num_stages, after.recomputed_blocks) == (1, ())


def test_the_memory_budget_has_one_reading() -> None:
    """Set: that many bytes, whatever the device; unset: 90% of a device whose memory is known (``plan --cluster``),
    no limit for a run's workers, which do not know it."""
    device_bytes = 16e9
    assert PipeConfig(device_memory_gb=0.5).memory_budget_bytes() == 500_000_000
    assert PipeConfig(device_memory_gb=0.5).memory_budget_bytes(device_bytes) == 500_000_000
    assert PipeConfig().memory_budget_bytes() == math.inf
    assert PipeConfig().memory_budget_bytes(device_bytes) == pytest.approx(0.9 * device_bytes)


def test_the_request_plans_as_the_settings_it_reads() -> None:
    """plan_request reads dp.enabled as elastic and train.precision's costs: the trainer's and plan's layout."""
    config = load_config(CONFIG, ["pipe.enabled=true", "dp.enabled=true", "pipe.schedule=1f1b",
                                  f"pipe.device_memory_gb={BUDGET_GB}"])
    request = plan_request(config.pipe, config.dp, BATCH, Precision.FP32)
    assert request.plan(COSTS, 2, frozen_blocks=0, cached_blocks=0) == plan_layout(
        config.pipe, COSTS, 2, elastic=True, batch_size=BATCH, frozen_blocks=0, cached_blocks=0)
