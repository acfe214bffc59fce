"""AutoPipe: cost model, exact partitioning, pipeline compression, micro-batches, rank layout, profiling.

The pure modules (cost, layout, partition, planner) import without torch, so the launcher and ``plan`` can check a
config and plan a layout before paying for it; profiling's two names, which need torch, load on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from pipetransformer.pipe.cost import (
    ADAMW_STATE_FACTOR,
    BlockCost,
    BlockState,
    BlockWork,
    Link,
    Precision,
    StageTiming,
    analytic_costs,
    analytic_work,
    as_trained,
    block_forward_seconds,
    block_memory,
    block_seconds,
    costs_from_work,
    recomputed,
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

_PROFILE = "pipetransformer.pipe.profile"
_TORCH_NAMES = {"broadcast_costs": _PROFILE, "profile_blocks": _PROFILE}
"""Re-exported names whose modules import torch: loaded by :func:`__getattr__` when first asked for."""


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        return getattr(import_module(_TORCH_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "ADAMW_STATE_FACTOR",
    "DEFAULT_MAX_MICRO_BATCH_FACTOR",
    "BlockCost",
    "BlockState",
    "BlockWork",
    "Layout",
    "LayoutError",
    "Link",
    "MicroBatchPlan",
    "Partition",
    "PartitionError",
    "Precision",
    "StagePlan",
    "StageTiming",
    "Transfer",
    "analytic_costs",
    "analytic_work",
    "as_trained",
    "block_forward_seconds",
    "block_memory",
    "block_owners",
    "block_seconds",
    "broadcast_costs",
    "bubble_fraction",
    "choose_micro_batches",
    "compress",
    "costs_from_work",
    "partition",
    "predict_step_time",
    "profile_blocks",
    "recomputed",
    "stage_memory",
    "stage_time",
    "stage_timing",
    "transfer_plan",
    "transfer_time",
    "valid_stage_counts",
]
