"""AutoCache on its own (one process): when blocks are cached, what a training or evaluation batch is served."""

from __future__ import annotations

import torch

from pipetransformer.config import CacheConfig, PipeConfig
from pipetransformer.freeze.apply import freeze_blocks
from pipetransformer.pipe.planner import LayoutPlan, plan_layout
from pipetransformer.train.autocache import AutoCache
from pipetransformer.train.elastic import UNIFORM_COST
from tiny import LAYERS, MAX_LENGTH, env, tiny_dataset, tiny_model

CACHE = CacheConfig(enabled=True, min_frozen=2, memory_gb=0.001)
EVAL_SAMPLES = 4


def _plan(frozen_blocks: int, cached_blocks: int) -> LayoutPlan:
    return plan_layout(PipeConfig(), [UNIFORM_COST] * (LAYERS + 2), 1, elastic=False, batch_size=8,
                       frozen_blocks=frozen_blocks, cached_blocks=cached_blocks)


def test_blocks_are_cached_from_min_frozen_layers_on_with_the_embeddings() -> None:
    cache = AutoCache(tiny_model(), env(), CACHE, train_set=tiny_dataset(), eval_samples=0, max_length=MAX_LENGTH)
    assert [cache.cached_blocks(layers) for layers in range(4)] == [0, 0, 3, 4]
    off = AutoCache(tiny_model(), env(), CacheConfig(), train_set=tiny_dataset(), eval_samples=0, max_length=MAX_LENGTH)
    assert off.cached_blocks(3) == 0


def test_training_and_evaluation_prefixes_equal_a_plain_forward_and_are_served_the_second_time() -> None:
    model, dataset = tiny_model(), tiny_dataset()
    freeze_blocks(model, range(3), None)
    cache = AutoCache(model, env(), CACHE, train_set=dataset, eval_samples=EVAL_SAMPLES, max_length=MAX_LENGTH)
    batch = dataset.get_batch([0, 1, 2])
    with torch.no_grad():
        plain = model.forward_range(batch.inputs, 0, 3)
    frozen_only = _plan(frozen_blocks=3, cached_blocks=0)
    assert torch.equal(cache.prefix(batch, frozen_only)[0], plain[0]), "no store: a no-grad forward"
    assert cache.metrics() is None and cache.evaluation_boundary(_plan(3, 3)) == 0
    try:
        cache.open(3)
        assert cache.store is not None and cache.store.layout.num_samples == len(dataset) + EVAL_SAMPLES
        cached = _plan(frozen_blocks=3, cached_blocks=3)
        for _ in range(2):
            assert torch.equal(cache.prefix(batch, cached)[0], plain[0])
        metrics = cache.metrics()
        assert metrics is not None and (metrics.computed, metrics.hits) == (3, 3)
        assert cache.evaluation_boundary(cached) == 3
        evaluated = cache.evaluation_prefix(batch.inputs, torch.tensor([0, 1, 2]), 3)
        assert torch.equal(evaluated[0], plain[0])
        assert cache.store.lookup(torch.tensor([len(dataset)])).tolist() == [3], "evaluation keys follow training's"
        assert cache.metrics().hits == 3, "an evaluation is not a training hit"  # type: ignore[union-attr]
    finally:
        cache.close()
