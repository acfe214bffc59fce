"""The layout planner: which memory a stage is checked against, per schedule."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipetransformer.config import load_config
from pipetransformer.pipe.cost import BlockCost
from pipetransformer.pipe.partition import PartitionError
from pipetransformer.pipe.planner import plan_layout, step_micro_batches

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_vit.yaml"
BATCH = 32
# 8 blocks whose activations (1 MB per sample) dwarf their parameters (1 KB): memory grows with the samples held.
COSTS = [BlockCost(forward_s=1e-3, backward_s=2e-3, output_bytes=1_000, param_bytes=1_000,
                   activation_bytes=1_000_000)] * 8
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


@pytest.mark.parametrize(("schedule", "micro_batches"), [("gpipe", "8"), ("1f1b", "auto")])
def test_gpipe_or_an_unchosen_count_is_checked_for_the_whole_batch(schedule: str, micro_batches: str) -> None:
    with pytest.raises(PartitionError, match="too small"):
        _plan(schedule, micro_batches)


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
