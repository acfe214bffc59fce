"""The step simulator: bubbles and held activations read off GPipe and 1F1B timelines, messages, the
bucketed all-reduce and its overlap with backward, stages built from block costs."""

from __future__ import annotations

import math

import pytest

from pipetransformer.pipe.cost import BlockCost, BlockState, Link, stage_memory
from pipetransformer.pipe.partition import bubble_fraction
from pipetransformer.plan.simulate import (
    ALLREDUCE,
    BACKWARD,
    FORWARD,
    StageWork,
    SyncGroup,
    allreduce_time,
    simulate_step,
    stage_works,
)

A, F, C = BlockState.ACTIVE, BlockState.FROZEN, BlockState.CACHED
FREE = Link(math.inf)
FORWARD_S, BACKWARD_S = 1.0, 2.0
ACTIVATIONS_PER_MICRO_BATCH = 10
WEIGHTS = 1000


def uniform_stage(**changes: object) -> StageWork:
    fields: dict[str, object] = {
        "forward_s": FORWARD_S, "backward_s": BACKWARD_S, "activation_out_bytes": 0, "gradient_out_bytes": 0,
        "gradient_buckets": (), "optimizer_s": 0.0, "fixed_memory_bytes": WEIGHTS,
        "activation_bytes_per_micro_batch": ACTIVATIONS_PER_MICRO_BATCH, "transient_bytes": 0,
    }
    return StageWork(**(fields | changes))  # type: ignore[arg-type]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "micro_batches"), [(1, 1), (2, 4), (4, 4), (4, 8), (8, 6), (3, 5), (4, 2)])
def test_bubble_read_off_the_timeline_is_the_formula_on_uniform_stages(schedule: str, stages: int,
                                                                       micro_batches: int) -> None:
    simulation = simulate_step([uniform_stage()] * stages, num_micro_batches=micro_batches, schedule=schedule,
                               links=[FREE] * (stages - 1))
    assert simulation.bubble_fraction == pytest.approx(bubble_fraction(stages, micro_batches))
    assert simulation.step_s == pytest.approx((micro_batches + stages - 1) * (FORWARD_S + BACKWARD_S))
    computations = [e for e in simulation.events if e.kind in (FORWARD, BACKWARD)]
    assert len(computations) == 2 * stages * micro_batches


@pytest.mark.parametrize(("stages", "micro_batches"), [(4, 8), (4, 2), (8, 6)])
def test_1f1b_holds_fewer_micro_batches_than_gpipe(stages: int, micro_batches: int) -> None:
    def peaks(schedule: str) -> tuple[list[int], list[int]]:
        simulation = simulate_step([uniform_stage()] * stages, num_micro_batches=micro_batches, schedule=schedule,
                                   links=[FREE] * (stages - 1))
        return simulation.peak_in_flight, simulation.stage_memory_bytes

    gpipe_peaks, gpipe_memory = peaks("gpipe")
    one_f_one_b, memory = peaks("1f1b")
    assert gpipe_peaks == [micro_batches] * stages
    assert one_f_one_b == [min(stages - s, micro_batches) for s in range(stages)]
    assert memory == [WEIGHTS + ACTIVATIONS_PER_MICRO_BATCH * peak for peak in one_f_one_b]
    assert max(memory) <= max(gpipe_memory)


def test_messages_delay_the_next_stage_and_the_gradient_comes_back() -> None:
    link = Link(bandwidth_bytes_per_s=100.0, latency_s=0.25)
    stages = [uniform_stage(activation_out_bytes=50, gradient_out_bytes=0),
              uniform_stage(activation_out_bytes=0, gradient_out_bytes=50)]
    simulation = simulate_step(stages, num_micro_batches=1, schedule="gpipe", links=[link])
    message = 50 / 100.0 + 0.25
    assert simulation.step_s == pytest.approx(FORWARD_S + message + FORWARD_S + BACKWARD_S + message + BACKWARD_S)
    assert {e.kind for e in simulation.events} >= {"activation", "gradient"}


def test_a_frozen_first_stage_runs_forwards_only_and_gets_no_gradient() -> None:
    stages = [uniform_stage(backward_s=0.0, activation_out_bytes=1), uniform_stage()]
    simulation = simulate_step(stages, num_micro_batches=3, schedule="1f1b", links=[Link(1.0)])
    assert not [e for e in simulation.events if e.stage == 0 and e.kind == BACKWARD]
    assert not [e for e in simulation.events if e.kind == "gradient"]
    assert simulation.peak_in_flight[0] == 0
    with pytest.raises(ValueError, match="frozen blocks are a prefix"):
        simulate_step(stages[::-1], num_micro_batches=1, schedule="gpipe", links=[FREE])


def test_bucketed_all_reduce_overlaps_the_last_backward() -> None:
    link = Link(bandwidth_bytes_per_s=1000.0)
    bucket = 500  # ring over 2: 2 x 1/2 x 500 / 1000 = 0.5 s each
    stage = uniform_stage(gradient_buckets=((bucket, 0.5), (bucket, 1.0)), optimizer_s=0.125)
    group = [SyncGroup(2, link, "net")]
    overlapped = simulate_step([stage], num_micro_batches=1, schedule="gpipe", links=[], sync=group, overlap=True)
    after = simulate_step([stage], num_micro_batches=1, schedule="gpipe", links=[], sync=group, overlap=False)
    each = allreduce_time(bucket, 2, link)
    assert each == pytest.approx(0.5)
    compute = FORWARD_S + BACKWARD_S
    # overlapped: the first bucket starts half-way through backward and is done when it ends
    assert overlapped.step_s == pytest.approx(compute + each + 0.125)
    assert after.step_s == pytest.approx(compute + 2 * each + 0.125)
    assert after.sync_exposed_s == pytest.approx(2 * each + 0.125)
    assert len([e for e in after.events if e.kind == ALLREDUCE]) == 2


def test_groups_sharing_a_network_interface_take_turns() -> None:
    link = Link(bandwidth_bytes_per_s=1000.0)
    stage = uniform_stage(gradient_buckets=((5000, 1.0),))
    each = allreduce_time(5000, 2, link)
    assert each == pytest.approx(5.0)

    def step(resources: tuple[str, str]) -> float:
        sync = [SyncGroup(2, link, resource) for resource in resources]
        return simulate_step([stage, stage], num_micro_batches=1, schedule="gpipe", links=[FREE], sync=sync).step_s

    # stage 1's backward ends at 4 (F 0-1, F 1-2, B 2-4), stage 0's at 6
    assert step(("a", "b")) == pytest.approx(6 + each)
    assert step(("nic", "nic")) == pytest.approx(4 + each + each), "stage 0's bucket waits for stage 1's"


def test_render_draws_each_stage() -> None:
    simulation = simulate_step([uniform_stage()] * 2, num_micro_batches=2, schedule="gpipe", links=[FREE])
    rows = simulation.render(width=20).splitlines()
    assert [row.split("|")[0].strip() for row in rows] == ["stage 0", "stage 1"]
    assert rows[0].split("|")[1].startswith("FFF") and rows[1].split("|")[1].startswith(".")


# --- stages from block costs -------------------------------------------------------------------


COSTS = [BlockCost(forward_s=1.0, backward_s=2.0, output_bytes=10, param_bytes=400, activation_bytes=7)] * 6


def test_stage_works_follow_the_block_states() -> None:
    states = [C, F, F, A, A, A]
    bounds = [(1, 3), (3, 4), (4, 6)]
    works = stage_works(COSTS, states, bounds, micro_batch_size=2, overhead_s=0.5, memory_bytes_per_s=math.inf,
                        bucket_bytes=10**9)
    frozen, first_active, last = works
    assert frozen.forward_s == 2 * 1.0 * 2 + 0.5 and not frozen.trains and frozen.gradient_buckets == ()
    assert frozen.cache_in_bytes == 10 * 2, "block 0's cached output is read into the first stage"
    assert first_active.gradient_out_bytes == 0, "nothing below block 3 trains"
    assert last.gradient_out_bytes == 10 * 2 and last.activation_out_bytes == 0
    assert last.backward_s == 2 * 2.0 * 2 + 0.5
    assert last.gradient_buckets == ((800, 1.0),)
    for work, (start, end) in zip(works, bounds, strict=True):
        assert work.fixed_memory_bytes + work.activation_bytes_per_micro_batch * 3 + work.transient_bytes == \
            stage_memory(COSTS, states, start, end, micro_batch_size=2, in_flight_micro_batches=3)


def test_stage_works_pay_each_blocks_cost_per_call_once_per_micro_batch() -> None:
    costs = [BlockCost(1.0, 2.0, 10, 400, 7, forward_fixed_s=3.0, backward_fixed_s=5.0)] * 3
    first, second = stage_works(costs, [F, A, A], [(0, 2), (2, 3)], micro_batch_size=4, overhead_s=0.5,
                                memory_bytes_per_s=math.inf, bucket_bytes=10**9)
    # the frozen block 0 runs forward only
    assert (first.forward_s, first.backward_s) == (2 * (4 + 3) + 0.5, 8 + 5 + 0.5)
    assert (second.forward_s, second.backward_s) == (4 + 3 + 0.5, 8 + 5 + 0.5)


def test_stage_works_run_frozen_blocks_at_their_frozen_forward() -> None:
    costs = [BlockCost(1.0, 2.0, 10, 400, 7, forward_fixed_s=3.0, backward_fixed_s=5.0, frozen_forward_s=0.5,
                       frozen_forward_fixed_s=1.0)] * 3
    first, second = stage_works(costs, [F, F, A], [(0, 2), (2, 3)], micro_batch_size=4, overhead_s=0.0,
                                memory_bytes_per_s=math.inf, bucket_bytes=10**9)
    assert (first.forward_s, first.backward_s) == (2 * (0.5 * 4 + 1.0), 0.0)
    assert (second.forward_s, second.backward_s) == (4 + 3, 8 + 5), "the active block's training forward"


def test_the_lowest_active_block_backs_up_without_its_input_gradient() -> None:
    costs = [BlockCost(1.0, 2.0, 10, 400, 7, backward_fixed_s=4.0, input_grad_share=0.5)] * 3
    first, second = stage_works(costs, [F, A, A], [(0, 2), (2, 3)], micro_batch_size=4, overhead_s=0.0,
                                memory_bytes_per_s=math.inf, bucket_bytes=10**9)
    assert first.backward_s == (2 * 4 + 4.0) / 2, "block 1 is the lowest active block"
    assert second.backward_s == 2 * 4 + 4.0


def test_touched_rows_are_summed_after_the_last_backward() -> None:
    table = BlockCost(1.0, 2.0, 10, 1_000, 7, row_summed_bytes=900, touched_row_bytes_per_sample=20)
    costs = [table, *COSTS[1:]]
    whole, = stage_works(costs, [A] * 6, [(0, 6)], micro_batch_size=2, overhead_s=0.0,
                         memory_bytes_per_s=math.inf, bucket_bytes=10**9)
    assert whole.gradient_buckets == ((1_000 + 5 * 400, 1.0),)
    by_rows, = stage_works(costs, [A] * 6, [(0, 6)], micro_batch_size=2, overhead_s=0.0,
                           memory_bytes_per_s=math.inf, bucket_bytes=10**9, touched_rows_samples=4)
    # the table leaves the bucket; the rows 4 samples touch follow it, once backward is done
    assert by_rows.gradient_buckets == ((100 + 5 * 400, 1.0), (4 * 20, 1.0))


def test_buckets_fill_from_the_last_block() -> None:
    works = stage_works(COSTS, [A] * 6, [(0, 6)], micro_batch_size=1, overhead_s=0.0, memory_bytes_per_s=math.inf,
                        bucket_bytes=800)
    assert works[0].gradient_buckets == ((800, pytest.approx(2 / 6)), (800, pytest.approx(4 / 6)),
                                         (800, pytest.approx(1.0)))
