"""An epoch sampler that stays exactly-once while the data-parallel width changes (AutoDP).

Design: the sampler hands out *global* batches from one seeded permutation per epoch, identical on
every rank (same seed, same position). Each replica then takes its contiguous share of the global
batch with ``split_for_replica``. No rank ever owns a fixed slice of the dataset, as it does with
``DistributedSampler``, so changing the width between any two steps needs no re-sharding: the next
global batch is simply split a different way, and each sample is still seen exactly once per epoch.
There is no padding either: at the tail a replica may get fewer samples, or none, so a trainer must
weight each replica's gradient by its sample count (sum losses, divide by the global batch length).

Pure Python and numpy, no torch, so the exactly-once property is tested fast with hypothesis.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["ElasticSampler"]


class ElasticSampler:
    """Global batches of sample indices in a seeded per-epoch order (``seed + epoch``), resumable mid-epoch."""

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True, drop_last: bool = False) -> None:
        if num_samples < 1:
            raise ValueError(f"the sampler needs a non-empty dataset, got num_samples={num_samples}")
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        return np.random.default_rng(self.seed + self.epoch).permutation(self.num_samples).tolist()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (its order depends only on ``seed + epoch``)."""
        if epoch < 0:
            raise ValueError(f"epochs count from 0, got epoch={epoch}")
        self.epoch = epoch
        self.position = 0
        self._order = self._epoch_order()

    def remaining(self) -> int:
        """Samples of this epoch not yet handed out (including a tail ``drop_last`` will drop)."""
        return self.num_samples - self.position

    def next_global_batch(self, batch_size: int) -> list[int] | None:
        """The next ``batch_size`` indices of this epoch, or ``None`` when the epoch is done.

        The last batch is shorter, unless ``drop_last``, which ends the epoch instead.
        """
        if batch_size < 1:
            raise ValueError(f"the global batch size must be >= 1, got {batch_size}")
        left = self.remaining()
        if left == 0 or (self.drop_last and left < batch_size):
            return None
        batch = self._order[self.position : self.position + batch_size]
        self.position += len(batch)
        return batch

    @staticmethod
    def split_for_replica(global_batch: list[int], width: int, replica: int) -> list[int]:
        """Replica ``replica``'s contiguous share of ``global_batch`` among ``width`` replicas.

        Shares differ by at most one sample; the first replicas get the extra ones, so tail replicas may
        get fewer or none. Together the shares are exactly the global batch, never a duplicate.
        """
        if width < 1:
            raise ValueError(f"the data-parallel width must be >= 1, got {width}")
        if not 0 <= replica < width:
            raise ValueError(f"replica must be in 0..{width - 1} for width {width}, got {replica}")
        base, extra = divmod(len(global_batch), width)
        start = replica * base + min(replica, extra)
        size = base + (1 if replica < extra else 0)
        return global_batch[start : start + size]

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable: where in which epoch, plus what fixes the order (checked on load)."""
        return {
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "position": self.position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        stored = (state["num_samples"], state["seed"], state["shuffle"])
        if stored != (self.num_samples, self.seed, self.shuffle):
            raise ValueError(
                f"sampler checkpoint has (num_samples, seed, shuffle)={stored}, this run has "
                f"{(self.num_samples, self.seed, self.shuffle)}: use the same dataset and seed to resume"
            )
        if not 0 <= state["position"] <= self.num_samples:
            raise ValueError(f"sampler checkpoint position {state['position']} is outside 0..{self.num_samples}")
        self.set_epoch(int(state["epoch"]))
        self.position = int(state["position"])
