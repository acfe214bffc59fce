"""AutoPipe: cost model, exact partitioning, pipeline compression, micro-batches, rank layout, profiling."""

from __future__ import annotations

from pipetransformer.pipe.cost import (
    ADAMW_STATE_FACTOR,
    BlockCost,
    BlockState,
    Link,
    StageTiming,
    analytic_costs,
    block_memory,
    block_seconds_per_sample,
    stage_memory,
    stage_time,
    stage_timing,
    transfer_time,
    validate_states,
)
from pipetransformer.pipe.layout import (
    Layout,
    LayoutError,
    StagePlan,
    Transfer,
    block_owners,
    transfer_plan,
    valid_stage_counts,
)
from pipetransformer.pipe.partition import (
    DEFAULT_MAX_MICRO_BATCH_FACTOR,
    MicroBatchPlan,
    Partition,
    PartitionError,
    bubble_fraction,
    choose_micro_batches,
    compress,
    partition,
    predict_step_time,
)
from pipetransformer.pipe.profile import profile_blocks

__all__ = [
    "ADAMW_STATE_FACTOR",
    "DEFAULT_MAX_MICRO_BATCH_FACTOR",
    "BlockCost",
    "BlockState",
    "Layout",
    "LayoutError",
    "Link",
    "MicroBatchPlan",
    "Partition",
    "PartitionError",
    "StagePlan",
    "StageTiming",
    "Transfer",
    "analytic_costs",
    "block_memory",
    "block_owners",
    "block_seconds_per_sample",
    "bubble_fraction",
    "choose_micro_batches",
    "compress",
    "partition",
    "predict_step_time",
    "profile_blocks",
    "stage_memory",
    "stage_time",
    "stage_timing",
    "transfer_plan",
    "transfer_time",
    "valid_stage_counts",
]
