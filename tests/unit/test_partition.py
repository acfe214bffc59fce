"""The cost model and AutoPipe's decisions, checked against hand arithmetic and brute force."""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetransformer.pipe.cost import (
    BlockCost,
    BlockState,
    Link,
    analytic_costs,
    as_trained,
    block_forward_seconds,
    block_memory,
    block_seconds,
    recomputed,
    stage_memory,
    stage_time,
    stage_timing,
    validate_states,
)
from pipetransformer.pipe.partition import (
    Partition,
    PartitionError,
    bubble_fraction,
    choose_micro_batches,
    choose_partition_and_micro_batches,
    compress,
    partition,
    predict_step_time,
)

A, F, C = BlockState.ACTIVE, BlockState.FROZEN, BlockState.CACHED
FREE_LINK = Link(math.inf)
HUGE_BUDGET = 10**15


def uniform(
    num_blocks: int,
    *,
    forward_s: float = 1.0,
    backward_s: float = 2.0,
    output_bytes: int = 10,
    param_bytes: int = 100,
    activation_bytes: int = 7,
) -> list[BlockCost]:
    return [BlockCost(forward_s, backward_s, output_bytes, param_bytes, activation_bytes)] * num_blocks


# --- cost model -------------------------------------------------------------------------------


def test_block_costs_by_state() -> None:
    cost = BlockCost(forward_s=1.0, backward_s=2.0, output_bytes=10, param_bytes=100, activation_bytes=7)
    assert block_seconds(cost, A)[0] == 3.0
    assert block_seconds(cost, F)[0] == 1.0
    assert block_seconds(cost, C)[0] == 0.0
    # params + grads + 2 AdamW moments + activations of 4 samples x 3 micro-batches in flight
    assert block_memory(cost, A, micro_batch_size=4, in_flight_micro_batches=3) == 100 * 4 + 7 * 4 * 3
    assert block_memory(cost, A, micro_batch_size=4, optimizer_state_factor=0) == 100 * 2 + 7 * 4
    assert block_memory(cost, F, micro_batch_size=4) == 100
    assert block_memory(cost, C, micro_batch_size=4) == 0


def test_stage_time_counts_boundary_messages() -> None:
    costs = uniform(4, output_bytes=1000)
    link = Link(bandwidth_bytes_per_s=100.0, latency_s=0.5)
    one_message = 1000 * 2 / 100.0 + 0.5  # micro-batch of 2
    compute = 3.0 * 2
    # first stage: output boundary only, activation forward + gradient backward
    first = stage_time(costs, [A] * 4, 0, 2, micro_batch_size=2, link=link)
    assert first == pytest.approx(compute * 2 + 2 * one_message)
    # middle stage: both boundaries
    middle = stage_time(costs, [A] * 4, 1, 3, micro_batch_size=2, link=link)
    assert middle == pytest.approx(compute * 2 + 4 * one_message)
    # whole model: no boundary
    assert stage_time(costs, [A] * 4, 0, 4, micro_batch_size=2, link=link) == pytest.approx(compute * 4)
    # below a boundary only frozen blocks: no gradient goes back
    states = [F, F, A, A]
    assert stage_time(costs, states, 2, 4, micro_batch_size=2, link=link) == pytest.approx(compute * 2 + one_message)
    # input served from the cache: no input boundary, cached blocks cost nothing
    states = [C, C, A, A]
    assert stage_time(costs, states, 2, 4, micro_batch_size=2, link=link) == pytest.approx(compute * 2)
    assert stage_memory(costs, states, 0, 4, micro_batch_size=2) == 2 * (100 * 4 + 7 * 2)


def test_costs_per_call_count_once_per_micro_batch() -> None:
    cost = BlockCost(forward_s=1.0, backward_s=2.0, output_bytes=0, param_bytes=0, activation_bytes=0,
                     forward_fixed_s=5.0, backward_fixed_s=7.0)
    assert cost.seconds(3) == (8.0, 13.0)
    assert (block_seconds(cost, A)[1], block_seconds(cost, F)[1], block_seconds(cost, C)[1]) == (12, 5, 0)
    timing = stage_timing([cost] * 3, [C, F, A], 1, 3, Link(math.inf, latency_s=0.5))
    # a frozen block's forward and an active one's both passes; no input message (the cache feeds the stage)
    assert (timing.seconds_per_sample, timing.fixed_s) == (1.0 + 3.0, 5.0 + 12.0 + 0.0)
    assert stage_time([cost] * 3, [A] * 3, 0, 2, micro_batch_size=4, link=Link(math.inf, latency_s=0.5)) == \
        pytest.approx(2 * (3.0 * 4 + 12.0) + 2 * 0.5)


def test_a_frozen_block_costs_its_frozen_forward() -> None:
    cost = BlockCost(forward_s=1.0, backward_s=2.0, output_bytes=0, param_bytes=0, activation_bytes=0,
                     forward_fixed_s=5.0, backward_fixed_s=7.0, frozen_forward_s=0.75, frozen_forward_fixed_s=4.0)
    assert block_seconds(cost, F) == (0.75, 4.0)
    assert block_seconds(cost, A) == (3.0, 12.0), "training: unchanged"
    assert [block_forward_seconds(cost, state, 4) for state in (A, F, C)] == [9.0, 7.0, 0.0]
    timing = stage_timing([cost] * 2, [F, A], 0, 2, Link(math.inf, latency_s=0.0))
    assert (timing.seconds_per_sample, timing.fixed_s) == (0.75 + 3.0, 4.0 + 12.0)
    # not measured (analytic costs): the frozen forward is the training forward
    unmeasured = replace(cost, frozen_forward_s=None, frozen_forward_fixed_s=None)
    assert unmeasured.frozen_forward == (1.0, 5.0) and unmeasured.frozen_seconds(4) == 9.0


def test_the_lowest_active_block_computes_no_input_gradient() -> None:
    cost = BlockCost(forward_s=1.0, backward_s=2.0, output_bytes=0, param_bytes=0, activation_bytes=0,
                     backward_fixed_s=4.0, input_grad_share=0.25)
    link = Link(math.inf, latency_s=0.0)
    # frozen below block 1: its backward drops a quarter; block 2, above a trainable block, keeps its own
    trained = as_trained([cost] * 3, [F, A, A])
    assert (trained[1].backward_s, trained[1].backward_fixed_s) == (1.5, 3.0) and trained[2] == cost
    timing = stage_timing([cost] * 3, [F, A, A], 1, 3, link)
    assert (timing.seconds_per_sample, timing.fixed_s) == (3.0 + 2.5, 4.0 + 3.0)
    assert stage_timing([cost] * 3, [F, A, A], 2, 3, link).fixed_s == 4.0, "not the lowest: unchanged"
    assert as_trained([cost] * 2, [F, F]) == [cost] * 2, "nothing trains: nothing to drop"
    # recomputed, the block re-runs its forward in backward; the input gradient still costs the same seconds
    again = as_trained([cost, recomputed(cost, input_bytes=0)], [F, A])[1]
    assert again.backward_s == pytest.approx(1.0 + 2.0 - 0.25 * 2.0)


def test_a_vocabulary_table_is_all_reduced_by_the_rows_a_step_can_touch() -> None:
    cost = BlockCost(forward_s=1.0, backward_s=2.0, output_bytes=0, param_bytes=1_000, activation_bytes=0,
                     row_summed_bytes=900, touched_row_bytes_per_sample=20)
    assert cost.allreduce_bytes(None) == (1_000, 0), "tables whole, as DDP"
    assert cost.allreduce_bytes(8) == (100, 160)
    assert cost.allreduce_bytes(100) == (100, 900), "never more rows than the table has"
    plain = BlockCost(forward_s=1.0, backward_s=2.0, output_bytes=0, param_bytes=1_000, activation_bytes=0)
    assert plain.allreduce_bytes(8) == (1_000, 0)


def test_states_must_grow_from_the_bottom() -> None:
    validate_states(uniform(4), [C, F, A, A])
    with pytest.raises(ValueError, match="cached..., then frozen..., then active"):
        validate_states(uniform(3), [A, F, A])
    with pytest.raises(ValueError, match="one state per block"):
        validate_states(uniform(3), [A, A])


def test_analytic_costs_shape_and_order() -> None:
    costs = analytic_costs(
        num_layers=3, hidden_size=32, seq_len=16, num_heads=4, vocab_size=1000, num_classes=2, flops_per_second=1e9
    )
    assert len(costs) == 5
    embeddings, layer, head = costs[0], costs[1], costs[-1]
    assert costs[1] == costs[2] == costs[3]
    assert layer.forward_s > embeddings.forward_s and layer.forward_s > head.forward_s
    assert layer.backward_s == pytest.approx(2 * layer.forward_s)
    assert layer.output_bytes == 16 * 32 * 4 + 16 * 8
    assert head.output_bytes == 2 * 4
    assert embeddings.param_bytes > layer.param_bytes  # a 1000-token table outweighs one small layer


# --- exact partitioner ------------------------------------------------------------------------


def brute_force(
    costs: list[BlockCost], states: list[BlockState], num_stages: int, micro_batch_size: int, budget: float, link: Link
) -> tuple[float, float]:
    """(best bottleneck or inf, smallest max stage memory) over all contiguous splits."""
    first = sum(s is C for s in states)
    best, least_memory = math.inf, math.inf
    for cuts in itertools.combinations(range(first + 1, len(costs)), num_stages - 1):
        edges = [first, *cuts, len(costs)]
        bounds = list(itertools.pairwise(edges))
        memories = [stage_memory(costs, states, s, e, micro_batch_size=micro_batch_size) for s, e in bounds]
        least_memory = min(least_memory, max(memories))
        if max(memories) <= budget:
            times = [stage_time(costs, states, s, e, micro_batch_size=micro_batch_size, link=link) for s, e in bounds]
            best = min(best, max(times))
    return best, least_memory


Problem = tuple[list[BlockCost], list[BlockState], int, int, int, Link]
"""costs, states, num_stages, micro_batch_size, memory budget, link"""


@st.composite
def problems(draw: st.DrawFn) -> Problem:
    num_blocks = draw(st.integers(1, 7))
    cached = draw(st.integers(0, num_blocks - 1))
    frozen = draw(st.integers(0, num_blocks - cached))
    states = [C] * cached + [F] * frozen + [A] * (num_blocks - cached - frozen)
    costs = [
        BlockCost(
            forward_s=draw(st.floats(0.0, 10.0)),
            backward_s=draw(st.floats(0.0, 10.0)),
            output_bytes=draw(st.integers(0, 1000)),
            param_bytes=draw(st.integers(0, 1000)),
            activation_bytes=draw(st.integers(0, 100)),
        )
        for _ in range(num_blocks)
    ]
    num_stages = draw(st.integers(1, num_blocks - cached))
    budget = draw(st.integers(0, 8000))
    link = Link(draw(st.floats(10.0, 1e4)), draw(st.floats(0.0, 1.0)))
    return costs, states, num_stages, draw(st.integers(1, 4)), budget, link


def check_well_formed(plan: Partition, states: list[BlockState], num_stages: int, num_blocks: int) -> None:
    assert plan.num_stages == num_stages
    assert plan.first_block == sum(s is C for s in states)
    assert plan.bounds[-1][1] == num_blocks
    for (_, end), (start, _) in itertools.pairwise(plan.bounds):
        assert end == start
    assert all(start < end for start, end in plan.bounds)


@settings(max_examples=300, deadline=None)
@given(problems())
def test_partition_matches_brute_force(problem: Problem) -> None:
    costs, states, num_stages, micro_batch_size, budget, link = problem

    def solve(memory_budget: int) -> Partition:
        return partition(
            costs, states, num_stages, micro_batch_size=micro_batch_size, memory_budget_bytes=memory_budget, link=link
        )

    best, least_memory = brute_force(costs, states, num_stages, micro_batch_size, budget, link)
    if math.isinf(best):
        with pytest.raises(PartitionError, match=f"needs at least {least_memory} bytes"):
            solve(budget)
        budget = int(least_memory)  # the budget the error asked for must be enough
        best, _ = brute_force(costs, states, num_stages, micro_batch_size, budget, link)
    plan = solve(budget)
    check_well_formed(plan, states, num_stages, len(costs))
    assert plan.bottleneck == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert max(plan.stage_memories) <= budget
    for (start, end), memory, seconds in zip(plan.bounds, plan.stage_memories, plan.stage_times, strict=True):
        assert memory == stage_memory(costs, states, start, end, micro_batch_size=micro_batch_size)
        expected = stage_time(costs, states, start, end, micro_batch_size=micro_batch_size, link=link)
        assert seconds == pytest.approx(expected)


def test_partition_balances_uneven_blocks() -> None:
    costs = [BlockCost(t, 0.0, 0, 0, 0) for t in (1.0, 1.0, 1.0, 1.0, 4.0)]
    plan = partition(costs, [A] * 5, 2, micro_batch_size=1, memory_budget_bytes=HUGE_BUDGET, link=FREE_LINK)
    assert plan.bounds == [(0, 4), (4, 5)]
    assert plan.bottleneck == 4.0


def test_memory_budget_moves_the_cut() -> None:
    costs = [BlockCost(1.0, 0.0, 0, param_bytes=p, activation_bytes=0) for p in (10, 10, 10, 10)]
    free = partition(costs, [A] * 4, 2, micro_batch_size=1, memory_budget_bytes=HUGE_BUDGET, link=FREE_LINK)
    assert free.bounds == [(0, 2), (2, 4)]
    # blocks take 40 bytes each when trainable; frozen only 10: the frozen bottom can hold more blocks
    tight = partition(costs, [F, F, F, A], 2, micro_batch_size=1, memory_budget_bytes=40, link=FREE_LINK)
    assert tight.bounds == [(0, 3), (3, 4)] and tight.stage_memories == [30, 40]


def test_more_stages_than_blocks_is_an_error() -> None:
    with pytest.raises(PartitionError, match="use at most 2 stages"):
        partition(uniform(4), [C, C, A, A], 3, micro_batch_size=1, memory_budget_bytes=HUGE_BUDGET, link=FREE_LINK)


def test_infeasible_budget_names_the_needed_budget() -> None:
    with pytest.raises(PartitionError, match=re.escape("needs at least 814 bytes")):
        # 4 active blocks in 2 stages: 2 x (100 x 4 + 7 x 1) = 814 per stage
        partition(uniform(4), [A] * 4, 2, micro_batch_size=1, memory_budget_bytes=813, link=FREE_LINK)


def test_cached_prefix_is_outside_every_stage() -> None:
    states = [C, C, F, A, A, A]
    plan = partition(uniform(6), states, 2, micro_batch_size=1, memory_budget_bytes=HUGE_BUDGET, link=FREE_LINK)
    assert plan.first_block == 2
    assert plan.stage_of(0) is None and plan.stage_of(1) is None
    assert plan.stage_of(2) == 0 and plan.stage_of(5) == 1
    with pytest.raises(IndexError):
        plan.stage_of(6)
    with pytest.raises(PartitionError, match="all 2 blocks are cached"):
        partition(uniform(2), [C, C], 1, micro_batch_size=1, memory_budget_bytes=HUGE_BUDGET, link=FREE_LINK)


def test_freezing_and_caching_shorten_the_bottleneck() -> None:
    costs = uniform(6)
    times = [
        partition(costs, states, 2, micro_batch_size=1, memory_budget_bytes=HUGE_BUDGET, link=FREE_LINK).bottleneck
        for states in ([A] * 6, [F, F, A, A, A, A], [C, C, A, A, A, A])
    ]
    # per-sample block times 3,3,3,3,3,3 / 1,1,3,3,3,3 / -,-,3,3,3,3 split as evenly as contiguity allows
    assert times == [9.0, 8.0, 6.0]


# --- compression ----------------------------------------------------------------------------


def test_compress_uses_one_stage_when_everything_fits() -> None:
    plan = compress(uniform(6), [A] * 6, 4, micro_batch_size=1, memory_budget_bytes=HUGE_BUDGET, link=FREE_LINK)
    assert plan.bounds == [(0, 6)]


def test_compress_picks_fewest_dividing_stages() -> None:
    costs = uniform(6)  # 407 bytes per trainable block
    # 3 blocks per stage (1221 bytes) fit only with >= 2 stages; world 6 allows 1, 2, 3, 6
    plan = compress(costs, [A] * 6, 6, micro_batch_size=1, memory_budget_bytes=1221, link=FREE_LINK)
    assert plan.num_stages == 2
    # world 9 allows 1, 3, 9: 2 is not an option, so 3
    plan = compress(costs, [A] * 6, 9, micro_batch_size=1, memory_budget_bytes=1221, link=FREE_LINK)
    assert plan.num_stages == 3
    # after freezing 3 blocks (100 bytes each) one stage fits: the pipeline collapses to data parallelism
    plan = compress(costs, [F, F, F, A, A, A], 6, micro_batch_size=1, memory_budget_bytes=1600, link=FREE_LINK)
    assert plan.num_stages == 1


def test_compress_infeasible_reports_world_size() -> None:
    with pytest.raises(PartitionError, match=r"world_size=2 \(1, 2\).*needs at least 814 bytes"):
        compress(uniform(4), [A] * 4, 2, micro_batch_size=1, memory_budget_bytes=500, link=FREE_LINK)


@settings(max_examples=100, deadline=None)
@given(problems(), st.integers(1, 8))
def test_compress_is_minimal(problem: Problem, world_size: int) -> None:
    costs, states, _, micro_batch_size, budget, link = problem
    plan: Partition | None
    try:
        plan = compress(
            costs, states, world_size, micro_batch_size=micro_batch_size, memory_budget_bytes=budget, link=link
        )
    except PartitionError:
        plan = None
    uncached = len(costs) - sum(s is C for s in states)
    for k in range(1, min(world_size, uncached) + 1):
        if world_size % k or (plan is not None and k >= plan.num_stages):
            continue
        assert math.isinf(brute_force(costs, states, k, micro_batch_size, budget, link)[0])
    if plan is not None:
        assert world_size % plan.num_stages == 0


# --- micro-batches ----------------------------------------------------------------------------


def test_bubble_and_step_prediction() -> None:
    assert bubble_fraction(1, 5) == 0.0
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    plan = partition(uniform(4), [A] * 4, 2, micro_batch_size=4, memory_budget_bytes=HUGE_BUDGET, link=FREE_LINK)
    # 2 stages of 6 s/sample; 4 micro-batches of 2 samples + 0.5 s overhead: (4 + 1) x (12 + 0.5)
    assert predict_step_time(plan, 8, 4, 0.5) == pytest.approx(5 * 12.5)


def test_step_prediction_fills_and_drains_at_each_stage_pace() -> None:
    costs = [BlockCost(forward_s=f, backward_s=2 * f, output_bytes=0, param_bytes=0, activation_bytes=0)
             for f in (3.0, 1.0, 1.0)]
    plan = partition(costs, [A] * 3, 2, micro_batch_size=1, memory_budget_bytes=HUGE_BUDGET, link=FREE_LINK)
    assert plan.bounds == [(0, 1), (1, 3)]
    # stages of 9 and 6 s per sample, 4 micro-batches of 1: 9 + 6 fill and drain, then 3 beats of 9
    assert predict_step_time(plan, 4, 4, 0.0) == pytest.approx(9 + 6 + 3 * 9)


def test_one_stage_means_one_micro_batch() -> None:
    plan = partition(uniform(4), [A] * 4, 1, micro_batch_size=16, memory_budget_bytes=HUGE_BUDGET, link=FREE_LINK)
    choice = choose_micro_batches(plan, 16, per_microbatch_overhead_s=0.01)
    assert choice.num_micro_batches == 1 and choice.micro_batch_size == 16 and choice.bubble_fraction == 0.0


def test_more_stages_more_micro_batches() -> None:
    costs = uniform(8, forward_s=1e-3, backward_s=2e-3)
    link = Link(1e6, latency_s=1e-4)
    chosen = []
    for num_stages in (1, 2, 4):
        plan = partition(costs, [A] * 8, num_stages, micro_batch_size=8, memory_budget_bytes=HUGE_BUDGET, link=link)
        choice = choose_micro_batches(plan, 64, per_microbatch_overhead_s=1e-3)
        assert choice.num_micro_batches >= num_stages and 64 % choice.num_micro_batches == 0
        candidates = [m for m in range(num_stages, 8 * num_stages + 1) if 64 % m == 0]
        assert choice.predicted_step_s == min(predict_step_time(plan, 64, m, 1e-3) for m in candidates)
        chosen.append(choice.num_micro_batches)
    assert chosen[0] == 1 and chosen[0] < chosen[1] < chosen[2]


def test_1f1b_partition_and_micro_batches_are_chosen_together() -> None:
    """Two 1F1B stages of 2 blocks hold 2 micro-batches of 16 / M samples: 800 bytes of training state + 28 per
    sample of a micro-batch, so the budget (912) fits them from M = 4 on (an uneven split never). Per stage and
    micro-batch: 6 s a sample + 5 s overhead, so a step takes 145 s at M = 4, 153 at 8, 187 at 16."""
    costs = uniform(4)
    budget = 2 * 100 * 4 + 2 * 7 * 4 * 2  # 2 blocks' weights, gradients and 2 moments; their activations at M = 4
    part, choice = choose_partition_and_micro_batches(costs, [A] * 4, 2, 16, memory_budget_bytes=budget,
                                                      link=FREE_LINK, per_microbatch_overhead_s=5.0)
    assert (choice.num_micro_batches, part.bounds) == (4, [(0, 2), (2, 4)])
    assert choice.predicted_step_s == predict_step_time(part, 16, 4, 5.0) == pytest.approx(145.0)
    with pytest.raises(PartitionError, match="fits"):
        choose_partition_and_micro_batches(costs, [A] * 4, 2, 16, memory_budget_bytes=2 * 100 * 4,
                                           link=FREE_LINK, per_microbatch_overhead_s=5.0)


def test_costs_per_call_favour_fewer_micro_batches() -> None:
    """The same blocks at 3 s a sample, with and without 24 s a call: the fixed part moves the choice from the
    largest candidate to fewer, larger micro-batches."""
    per_sample = uniform(4, forward_s=1.0, backward_s=2.0)
    per_call = [BlockCost(1.0, 2.0, 10, 100, 7, forward_fixed_s=8.0, backward_fixed_s=16.0)] * 4
    choices = []
    for costs in (per_sample, per_call):
        part = partition(costs, [A] * 4, 2, micro_batch_size=1, memory_budget_bytes=HUGE_BUDGET, link=FREE_LINK)
        choices.append(choose_micro_batches(part, 16, per_microbatch_overhead_s=0.0).num_micro_batches)
    # stages of 2 blocks: M = 2 takes 3 beats of 2 x (3 x 8 + 24) = 288 s; M = 16: 17 beats of 2 x (3 + 24) = 918 s
    assert choices == [16, 2]


def test_micro_batches_divide_awkward_batches() -> None:
    plan = partition(uniform(4), [A] * 4, 2, micro_batch_size=1, memory_budget_bytes=HUGE_BUDGET, link=FREE_LINK)
    assert choose_micro_batches(plan, 7, per_microbatch_overhead_s=0.0).num_micro_batches == 7
    plan4 = partition(uniform(4), [A] * 4, 4, micro_batch_size=1, memory_budget_bytes=HUGE_BUDGET, link=FREE_LINK)
    # batch 3 on 4 stages: no divisor >= 4, so the best divisor overall
    assert choose_micro_batches(plan4, 3, per_microbatch_overhead_s=0.0).num_micro_batches == 3
