"""AutoDP's width and batch policy, pure: how many replicas a layout runs, the global batch at a width
(``dp.batch_policy``), each replica's share of it, and the learning rate's scale. The planner
(``pipe/planner.py``) sizes a layout with it; the run (``train/elastic.py``) splits each step's batch by it."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["KEEP_PER_PIPELINE", "global_batch", "lr_scale", "replica_batch", "replica_count"]

KEEP_PER_PIPELINE = "keep_per_pipeline"
"""``dp.batch_policy`` of the paper: each replica keeps the batch it started with (the other: ``keep_global``)."""


def replica_count(world_size: int, stages: int, *, elastic: bool, initial_width: int | None) -> int:
    """Replicas of a ``stages``-stage layout: with AutoDP (``elastic``), or before the run's first layout, every
    worker the stages leave; without it the width the run started with, the freed workers idling."""
    if elastic or initial_width is None:
        return world_size // stages
    return initial_width


def global_batch(batch_size: int, width: int, initial_width: int | None, policy: str) -> int:
    """``keep_global``: ``batch_size`` (``train.batch_size``) always; ``keep_per_pipeline``: each replica keeps the
    batch it started with, so the global batch grows with the width."""
    if policy == KEEP_PER_PIPELINE and initial_width:
        return batch_size * width // initial_width
    return batch_size


def lr_scale(batch_size: int, width: int, initial_width: int | None, policy: str) -> float:
    """The linear scaling rule: the learning rate grows as the global batch does (keep_per_pipeline)."""
    return global_batch(batch_size, width, initial_width, policy) / batch_size


def replica_batch(width: int, batch_size: int, batch_at: Callable[[int], int] | None) -> int:
    """Each of ``width`` replicas' share of the global batch ``batch_at(width)`` (default: ``batch_size``)."""
    return max(1, (batch_at(width) if batch_at else batch_size) // width)
