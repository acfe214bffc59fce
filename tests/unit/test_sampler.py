"""The elastic sampler: every sample exactly once per epoch, whatever the data-parallel width does."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetransformer.data.sampler import ElasticSampler

MAX_WIDTH = 8


def epoch_batches(sampler: ElasticSampler, batch_size: int) -> list[list[int]]:
    batches = []
    while (batch := sampler.next_global_batch(batch_size)) is not None:
        batches.append(batch)
    return batches


@settings(max_examples=150, deadline=None)
@given(
    num_samples=st.integers(1, 300),
    batch_size=st.integers(1, 40),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 5),
    data=st.data(),
)
def test_each_sample_exactly_once_while_the_width_changes_at_random_steps(
    num_samples: int, batch_size: int, drop_last: bool, shuffle: bool, seed: int, epoch: int, data: st.DataObject
) -> None:
    sampler = ElasticSampler(num_samples, seed, shuffle=shuffle, drop_last=drop_last)
    sampler.set_epoch(epoch)
    seen: list[int] = []
    width = data.draw(st.integers(1, MAX_WIDTH))
    while (global_batch := sampler.next_global_batch(batch_size)) is not None:
        if data.draw(st.booleans()):
            width = data.draw(st.integers(1, MAX_WIDTH))
        shares = [ElasticSampler.split_for_replica(global_batch, width, replica) for replica in range(width)]
        assert [i for share in shares for i in share] == global_batch  # contiguous, in order, nothing padded
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
        seen.extend(i for share in shares for i in share)
    assert len(seen) == len(set(seen))
    kept = num_samples - num_samples % batch_size if drop_last else num_samples
    assert len(seen) == kept and set(seen) <= set(range(num_samples))
    if not shuffle:
        assert seen == list(range(kept))
    assert sampler.position == kept and sampler.remaining() == num_samples - kept


def test_tail_replicas_get_fewer_or_none_instead_of_duplicates() -> None:
    shares = [ElasticSampler.split_for_replica([7, 8, 9], 5, replica) for replica in range(5)]
    assert shares == [[7], [8], [9], [], []]
    shares = [ElasticSampler.split_for_replica(list(range(10)), 3, replica) for replica in range(3)]
    assert shares == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]


def test_the_last_batch_is_short_unless_drop_last() -> None:
    assert [len(b) for b in epoch_batches(ElasticSampler(10, seed=0), 4)] == [4, 4, 2]
    assert [len(b) for b in epoch_batches(ElasticSampler(10, seed=0, drop_last=True), 4)] == [4, 4]


def test_order_is_deterministic_for_a_seed_and_differs_between_epochs_and_seeds() -> None:
    first, second, other_seed = ElasticSampler(50, seed=3), ElasticSampler(50, seed=3), ElasticSampler(50, seed=4)
    assert epoch_batches(first, 7) == epoch_batches(second, 7)
    first.set_epoch(0)
    epoch_zero = epoch_batches(first, 50)
    first.set_epoch(1)
    assert first.position == 0
    epoch_one = epoch_batches(first, 50)
    assert epoch_zero != epoch_one and sorted(epoch_zero[0]) == sorted(epoch_one[0])
    assert epoch_batches(other_seed, 50) != epoch_zero


@settings(max_examples=60, deadline=None)
@given(
    num_samples=st.integers(1, 200),
    batch_size=st.integers(1, 30),
    seed=st.integers(0, 1000),
    epoch=st.integers(0, 3),
    data=st.data(),
)
def test_mid_epoch_resume_continues_identically(
    num_samples: int, batch_size: int, seed: int, epoch: int, data: st.DataObject
) -> None:
    original = ElasticSampler(num_samples, seed)
    original.set_epoch(epoch)
    for _ in range(data.draw(st.integers(0, num_samples // batch_size + 1))):
        original.next_global_batch(batch_size)
    resumed = ElasticSampler(num_samples, seed)
    resumed.load_state_dict(json.loads(json.dumps(original.state_dict())))
    assert resumed.position == original.position and resumed.epoch == epoch
    assert epoch_batches(resumed, batch_size) == epoch_batches(original, batch_size)


def test_checkpoint_of_another_dataset_or_seed_is_refused() -> None:
    state = ElasticSampler(10, seed=1).state_dict()
    with pytest.raises(ValueError, match="same dataset and seed"):
        ElasticSampler(11, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="same dataset and seed"):
        ElasticSampler(10, seed=2).load_state_dict(state)


@pytest.mark.parametrize(("width", "replica"), [(0, 0), (2, 2), (2, -1)])
def test_bad_widths_and_replicas_are_rejected(width: int, replica: int) -> None:
    with pytest.raises(ValueError, match="width|replica"):
        ElasticSampler.split_for_replica([1, 2], width, replica)


def test_bad_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="num_samples"):
        ElasticSampler(0, seed=0)
    with pytest.raises(ValueError, match="batch size"):
        ElasticSampler(3, seed=0).next_global_batch(0)
