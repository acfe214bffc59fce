"""AutoDP's width and batch policy: replicas of a layout, the global batch and learning-rate scale per width."""

from __future__ import annotations

import pytest

from pipetransformer.dp.batch import KEEP_PER_PIPELINE, global_batch, lr_scale, replica_batch, replica_count

BATCH = 16


def test_replicas_are_the_workers_the_stages_leave_only_with_autodp() -> None:
    assert replica_count(4, 2, elastic=True, initial_width=1) == 2
    assert replica_count(4, 1, elastic=False, initial_width=1) == 1, "without AutoDP freed workers idle"
    assert replica_count(4, 2, elastic=False, initial_width=None) == 2, "the first layout takes every worker"


def test_keep_per_pipeline_grows_the_global_batch_and_the_rate_with_the_width() -> None:
    assert [global_batch(BATCH, width, 1, KEEP_PER_PIPELINE) for width in (1, 2, 4)] == [16, 32, 64]
    assert lr_scale(BATCH, 4, 2, KEEP_PER_PIPELINE) == pytest.approx(2.0)
    assert global_batch(BATCH, 4, 1, "keep_global") == BATCH and lr_scale(BATCH, 4, 1, "keep_global") == 1.0
    assert global_batch(BATCH, 2, None, KEEP_PER_PIPELINE) == BATCH, "before the first layout: train.batch_size"


def test_each_replica_takes_its_share_and_at_least_one_sample() -> None:
    assert replica_batch(4, BATCH, None) == 4
    assert replica_batch(4, BATCH, lambda width: global_batch(BATCH, width, 2, KEEP_PER_PIPELINE)) == 8
    assert replica_batch(32, BATCH, None) == 1
