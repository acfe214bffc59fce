"""Which rank runs which stage of which replica, and what moves when that changes.

``rank = replica * num_stages + stage``: a pipeline's stages are neighbouring ranks, and the ranks
of one stage across replicas form its data-parallel group. Pure, so every rank computes the same
groups and the same transfer plan without talking to the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "Layout",
    "LayoutError",
    "StagePlan",
    "Transfer",
    "block_owners",
    "check_stage_count",
    "transfer_plan",
    "valid_stage_counts",
]


class LayoutError(ValueError):
    """A layout that cannot be built; the message says which sizes are allowed."""


class StagePlan(Protocol):
    """What a layout needs from a partition: the block range of every stage."""

    @property
    def bounds(self) -> list[tuple[int, int]]: ...


def valid_stage_counts(world_size: int) -> list[int]:
    """Stage counts that use all ``world_size`` ranks: its divisors, ascending."""
    if world_size < 1:
        raise LayoutError(f"world_size must be >= 1, got {world_size}")
    return [k for k in range(1, world_size + 1) if world_size % k == 0]


def check_stage_count(stages: int, world_size: int) -> None:
    """``pipe.stages`` fixed at a number must divide the workers (checked by the launcher and by the planner)."""
    allowed = valid_stage_counts(world_size)
    if stages not in allowed:
        raise LayoutError(f"pipe.stages={stages} does not divide the {world_size} workers: set pipe.stages to one "
                          f"of {', '.join(map(str, allowed))} or auto, or change --nproc-per-node")


@dataclass(frozen=True)
class Layout:
    """``dp_width`` replicas of a ``num_stages``-stage pipeline."""

    num_stages: int
    dp_width: int

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.dp_width < 1:
            raise LayoutError(f"num_stages and dp_width must be >= 1, got {self.num_stages} and {self.dp_width}")

    @classmethod
    def for_world_size(cls, world_size: int, num_stages: int) -> Layout:
        allowed = valid_stage_counts(world_size)
        if num_stages not in allowed:
            raise LayoutError(
                f"num_stages={num_stages} does not divide world_size={world_size}; "
                f"allowed: {', '.join(map(str, allowed))}"
            )
        return cls(num_stages, world_size // num_stages)

    @property
    def world_size(self) -> int:
        return self.num_stages * self.dp_width

    def rank(self, replica: int, stage: int) -> int:
        self._check(replica, self.dp_width, "replica")
        self._check(stage, self.num_stages, "stage")
        return replica * self.num_stages + stage

    def coords(self, rank: int) -> tuple[int, int]:
        """``(replica, stage)`` of ``rank``."""
        self._check(rank, self.world_size, "rank")
        return divmod(rank, self.num_stages)

    def pipeline_ranks(self, replica: int) -> list[int]:
        return [self.rank(replica, stage) for stage in range(self.num_stages)]

    def dp_ranks(self, stage: int) -> list[int]:
        return [self.rank(replica, stage) for replica in range(self.dp_width)]

    def all_pipeline_groups(self) -> list[list[int]]:
        """Every replica's pipeline, by replica: the order in which every rank must create the groups."""
        return [self.pipeline_ranks(replica) for replica in range(self.dp_width)]

    def all_dp_groups(self) -> list[list[int]]:
        """Every stage's data-parallel group, by stage: the order in which every rank must create them."""
        return [self.dp_ranks(stage) for stage in range(self.num_stages)]

    @staticmethod
    def _check(index: int, size: int, what: str) -> None:
        if not 0 <= index < size:
            raise LayoutError(f"{what} {index} is outside 0..{size - 1}")


@dataclass(frozen=True, order=True)
class Transfer:
    """``src_rank`` sends its copy of ``block``'s parameters to ``dst_rank``."""

    block: int
    src_rank: int
    dst_rank: int


def block_owners(partition: StagePlan, layout: Layout) -> dict[int, list[int]]:
    """Block -> the ranks holding it (ascending). Cached blocks belong to no stage, hence to no rank."""
    if len(partition.bounds) != layout.num_stages:
        raise LayoutError(
            f"the partition has {len(partition.bounds)} stages but the layout {layout.num_stages}: "
            "build both for the same stage count"
        )
    return {
        block: layout.dp_ranks(stage)
        for stage, (start, end) in enumerate(partition.bounds)
        for block in range(start, end)
    }


def transfer_plan(
    old_partition: StagePlan, old_layout: Layout, new_partition: StagePlan, new_layout: Layout
) -> list[Transfer]:
    """One transfer per (new owner, block it did not hold), sorted by destination then block.

    The source is an old owner of the same replica index if there is one (replicas are then rebuilt
    side by side and the load spreads over them), else the lowest old owner.
    """
    old = block_owners(old_partition, old_layout)
    new = block_owners(new_partition, new_layout)
    plan = []
    for block, owners in sorted(new.items()):
        sources = old.get(block)
        if not sources:
            raise LayoutError(
                f"block {block} is needed by ranks {owners} but no rank held it before: "
                "it cannot come back from the cache"
            )
        for dst in owners:
            if dst in sources:
                continue
            replica = new_layout.coords(dst)[0]
            same_replica = [src for src in sources if old_layout.coords(src)[0] == replica]
            plan.append(Transfer(block, (same_replica or sources)[0], dst))
    return sorted(plan, key=lambda t: (t.dst_rank, t.block))
