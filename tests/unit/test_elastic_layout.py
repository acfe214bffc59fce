"""ElasticLayout in one process: where a rank sits, the batch and rate for a width, what a transition builds.
(Transitions between ranks: tests/integration/test_layout_transition.py.)"""

from __future__ import annotations

from pipetransformer.config import CacheConfig, DPConfig, PipeConfig, TrainConfig
from pipetransformer.freeze.apply import freeze_blocks
from pipetransformer.pipe.planner import plan_layout
from pipetransformer.train.elastic import UNIFORM_COST, Placement
from pipetransformer.train.optimizer import HeldOptimizer
from pipetransformer.train.step import LocalStep
from tiny import LAYERS, env, layout, tiny_dataset, tiny_model

BLOCKS = LAYERS + 2
BATCH = 8


def test_a_placement_knows_its_stage_its_blocks_and_its_share_of_a_batch() -> None:
    plan = plan_layout(PipeConfig(enabled=True, stages=2), [UNIFORM_COST] * BLOCKS, 4, elastic=True, batch_size=BATCH,
                       frozen_blocks=0, cached_blocks=0)
    assert (plan.layout.num_stages, plan.layout.dp_width) == (2, 2)
    last = Placement.of(plan, 3)
    assert (last.replica, last.stage, last.last_stage) == (1, 1, True)
    assert last.blocks == plan.partition.bounds[1] and Placement.of(plan, 0).blocks[0] == 0
    assert last.share(list(range(5))) == [3, 4]
    idle = Placement.of(plan_layout(PipeConfig(), [UNIFORM_COST] * BLOCKS, 1, elastic=False, batch_size=BATCH,
                                    frozen_blocks=0, cached_blocks=0), 1)
    assert (idle.replica, idle.stage, idle.blocks, idle.last_stage) == (None, None, (0, 0), False)


def test_keep_per_pipeline_grows_the_batch_and_the_rate_with_the_width() -> None:
    elastic = layout(tiny_model(), tiny_dataset(), env(), dp=DPConfig(batch_policy="keep_per_pipeline"))
    kept = layout(tiny_model(), tiny_dataset(), env())
    for each in (elastic, kept):
        each.initial_width = 1
    assert (elastic.global_batch(2), kept.global_batch(2)) == (2 * BATCH, BATCH)
    model = tiny_model()
    single = layout(model, tiny_dataset(), env(), dp=DPConfig(batch_policy="keep_per_pipeline"))
    single.transition(single.plan_for(0, 0), HeldOptimizer(model, TrainConfig()))
    assert single.lr_scale() == 1.0 and single.initial_width == 1


def test_a_transition_rebuilds_optimizer_and_executor_and_opens_the_cache_it_needs() -> None:
    model = tiny_model()
    elastic = layout(model, tiny_dataset(), env(), cache=CacheConfig(enabled=True, memory_gb=0.001))
    optimizer = HeldOptimizer(model, TrainConfig())
    assert elastic.costs() == [UNIFORM_COST] * BLOCKS, "without AutoPipe every block costs the same"
    assert elastic.transition(elastic.plan_for(0, 0), optimizer) is None, "the first layout is no transition"
    assert isinstance(elastic.executor, LocalStep) and len(optimizer.params) == 2 * BLOCKS
    assert elastic.context.prefix.store is None
    try:
        freeze_blocks(model, range(2), optimizer.optimizer)
        record = elastic.transition(elastic.plan_for(frozen_blocks=2, cached_blocks=2), optimizer)
        assert record is not None and record["blocks_moved"] == 0 and record["seconds"] >= 0.0
        assert elastic.plan.cached_blocks == 2 and elastic.context.prefix.store is not None
        assert len(optimizer.params) == 2 * (BLOCKS - 2)
        assert elastic.owners() == dict.fromkeys(range(BLOCKS), 0)
    finally:
        elastic.context.prefix.close()


def test_a_resume_keeps_the_starting_width_only_on_as_many_workers() -> None:
    elastic = layout(tiny_model(), tiny_dataset(), env())
    elastic.load_state_dict({"initial_width": 2, "world_size": 2})
    assert elastic.initial_width is None
    elastic.load_state_dict({"initial_width": 1, "world_size": 1})
    assert elastic.initial_width == 1 and elastic.state_dict() == {"initial_width": 1, "world_size": 1}


def test_the_gradient_buckets_are_the_dp_setting() -> None:
    model = tiny_model()
    one_parameter_each = layout(model, tiny_dataset(), env(), dp=DPConfig(bucket_mib=1e-9))
    one_parameter_each.transition(one_parameter_each.plan_for(0, 0), HeldOptimizer(model, TrainConfig()))
    assert isinstance(one_parameter_each.executor, LocalStep)
    assert [len(bucket) for bucket in one_parameter_each.executor.sync.buckets] == [1] * 2 * BLOCKS
