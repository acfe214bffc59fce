"""Rank layout, process groups and the parameter transfer plan between layouts."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetransformer.pipe.layout import (Layout, LayoutError, Transfer, block_owners, check_stage_count, transfer_plan,
                                         valid_stage_counts)


@dataclass(frozen=True)
class Bounds:
    bounds: list[tuple[int, int]]


def split(first: int, cuts: list[int], num_blocks: int) -> Bounds:
    edges = [first, *cuts, num_blocks]
    return Bounds(list(itertools.pairwise(edges)))


def test_rank_mapping_and_groups() -> None:
    layout = Layout(num_stages=3, dp_width=2)
    assert layout.world_size == 6
    assert [layout.coords(r) for r in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert all(layout.rank(*layout.coords(r)) == r for r in range(6))
    assert layout.pipeline_ranks(1) == [3, 4, 5]
    assert layout.dp_ranks(2) == [2, 5]
    assert layout.all_pipeline_groups() == [[0, 1, 2], [3, 4, 5]]
    assert layout.all_dp_groups() == [[0, 3], [1, 4], [2, 5]]
    with pytest.raises(LayoutError, match="rank 6 is outside 0..5"):
        layout.coords(6)


@pytest.mark.parametrize("world_size", [1, 4, 6, 8])
def test_groups_cover_the_world_once(world_size: int) -> None:
    for num_stages in valid_stage_counts(world_size):
        layout = Layout.for_world_size(world_size, num_stages)
        for groups in (layout.all_pipeline_groups(), layout.all_dp_groups()):
            assert sorted(r for g in groups for r in g) == list(range(world_size))
        assert layout.all_dp_groups() == Layout.for_world_size(world_size, num_stages).all_dp_groups()


def test_stage_count_must_divide_world_size() -> None:
    assert valid_stage_counts(6) == [1, 2, 3, 6]
    with pytest.raises(LayoutError, match="num_stages=4 does not divide world_size=6; allowed: 1, 2, 3, 6"):
        Layout.for_world_size(6, 4)
    with pytest.raises(LayoutError):
        Layout(0, 2)


def test_block_owners_skip_cached_blocks() -> None:
    owners = block_owners(split(2, [4], 6), Layout(2, 2))
    assert owners == {2: [0, 2], 3: [0, 2], 4: [1, 3], 5: [1, 3]}
    with pytest.raises(LayoutError, match="3 stages but the layout 2"):
        block_owners(split(0, [2, 4], 6), Layout(2, 2))


def test_four_stages_to_two_by_two() -> None:
    old = split(0, [1, 2, 3], 4)  # one block per rank
    new = split(0, [2], 4)  # ranks 0, 2 hold blocks 0-1; ranks 1, 3 hold blocks 2-3
    plan = transfer_plan(old, Layout(4, 1), new, Layout(2, 2))
    assert plan == [
        Transfer(block=1, src_rank=1, dst_rank=0),
        Transfer(block=2, src_rank=2, dst_rank=1),
        Transfer(block=3, src_rank=3, dst_rank=1),
        Transfer(block=0, src_rank=0, dst_rank=2),
        Transfer(block=1, src_rank=1, dst_rank=2),
        Transfer(block=2, src_rank=2, dst_rank=3),
    ]


def test_same_replica_source_is_preferred() -> None:
    # 2x2, stages 0 / 1-3 -> 0-1 / 2-3: block 1 was held by ranks 1 (replica 0) and 3 (replica 1)
    plan = transfer_plan(split(0, [1], 4), Layout(2, 2), split(0, [2], 4), Layout(2, 2))
    assert plan == [
        Transfer(block=1, src_rank=1, dst_rank=0),
        Transfer(block=1, src_rank=3, dst_rank=2),  # replica 1 takes it from replica 1, not from the lowest rank
    ]
    # 2x2 -> 1x4: new replicas 2 and 3 had no counterpart, so the lowest holder sends
    plan = transfer_plan(split(0, [2], 4), Layout(2, 2), split(0, [], 4), Layout(1, 4))
    assert Transfer(block=0, src_rank=0, dst_rank=3) in plan
    assert Transfer(block=2, src_rank=1, dst_rank=2) in plan


def test_blocks_cannot_return_from_the_cache() -> None:
    with pytest.raises(LayoutError, match="block 1 is needed"):
        transfer_plan(split(2, [], 4), Layout(1, 2), split(1, [], 4), Layout(1, 2))


ReLayout = list[tuple[Bounds, Layout]]


@st.composite
def re_layouts(draw: st.DrawFn) -> ReLayout:
    world_size = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    num_blocks = draw(st.integers(1, 10))
    old_first = draw(st.integers(0, num_blocks - 1))
    new_first = draw(st.integers(old_first, num_blocks - 1))
    layouts_and_splits = []
    for first in (old_first, new_first):
        counts = [k for k in valid_stage_counts(world_size) if k <= num_blocks - first]
        num_stages = draw(st.sampled_from(counts))
        inner = range(first + 1, num_blocks)
        cuts = sorted(draw(st.permutations(list(inner)))[: num_stages - 1])
        layouts_and_splits.append((split(first, cuts, num_blocks), Layout.for_world_size(world_size, num_stages)))
    return layouts_and_splits


@settings(max_examples=300, deadline=None)
@given(re_layouts())
def test_applying_the_plan_gives_every_owner_its_blocks(case: ReLayout) -> None:
    (old, old_layout), (new, new_layout) = case
    plan = transfer_plan(old, old_layout, new, new_layout)
    assert plan == transfer_plan(old, old_layout, new, new_layout)
    old_owners = block_owners(old, old_layout)
    held = {rank: {b for b, owners in old_owners.items() if rank in owners} for rank in range(old_layout.world_size)}
    for transfer in plan:
        sources = old_owners[transfer.block]
        assert transfer.src_rank in sources and transfer.block not in held[transfer.dst_rank]
        same_replica = [s for s in sources if old_layout.coords(s)[0] == new_layout.coords(transfer.dst_rank)[0]]
        assert transfer.src_rank == min(same_replica or sources)
        held[transfer.dst_rank].add(transfer.block)
    for block, owners in block_owners(new, new_layout).items():
        assert all(block in held[rank] for rank in owners)
    assert len({(t.block, t.dst_rank) for t in plan}) == len(plan)


def test_a_fixed_stage_count_must_divide_the_workers() -> None:
    check_stage_count(2, 4)
    with pytest.raises(LayoutError, match="pipe.stages=3 does not divide the 4 workers: set pipe.stages to one of "
                                          "1, 2, 4"):
        check_stage_count(3, 4)
