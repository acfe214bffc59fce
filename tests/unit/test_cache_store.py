"""ActivationStore: bit-exact records, spilling, corruption, disk failures, file hygiene."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pipetransformer.cache.store import (
    DEFAULT_SHM_DIR,
    EMPTY_BOUNDARY,
    FILE_PREFIX,
    ActivationStore,
    spec_from_activation,
)
from pipetransformer.models.blocks import Activation, ActivationSpec

NUM_SAMPLES = 10
MAX_LEN = 8
DIM = 4
IMAGE_TOKENS = 5
DROP_FILE_PERMISSION_OVERRIDES = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]
"""Root ignores file modes; without these capabilities a read-only directory is read-only for it too."""
FILE_SIZE_LIMIT = 1024
TEXT_SPEC = ActivationSpec(shapes=((MAX_LEN, DIM), (MAX_LEN,)), dtypes=(torch.float32, torch.int64))
LOOSE_BUDGET = 1 << 20



def _text_batch(batch: int, length: int, seed: int) -> Activation:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, length, DIM, generator=generator)
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(torch.int64)
    return hidden, mask


def _memory_bytes_for(records: int) -> int:
    """A budget that fits the index arrays and ``records`` records (alignment slack included)."""
    index_bytes = NUM_SAMPLES * (4 + 8 + 8) + 64 * 2  # boundary, checksum, sequence number
    slack = 64 * 2
    return index_bytes + records * TEXT_SPEC.bytes_per_sample + slack


def test_round_trip_is_bit_exact_and_trims(tmp_path: Path) -> None:
    with ActivationStore.create(NUM_SAMPLES, TEXT_SPEC, LOOSE_BUDGET, tmp_path) as store:
        store.unlink_names()
        indices = torch.tensor([7, 1, 4])
        hidden, mask = _text_batch(3, 6, seed=0)
        assert store.write(indices, (hidden, mask), boundary=2).all()

        trimmed = store.read(indices, trim_to=6)
        assert trimmed.served.all()
        assert torch.equal(trimmed.boundaries, torch.tensor([2, 2, 2], dtype=torch.int32))
        assert torch.equal(trimmed.activation[0], hidden)
        assert torch.equal(trimmed.activation[1], mask)

        shorter = store.read(indices, trim_to=4)
        assert torch.equal(shorter.activation[0], hidden[:, :4])

        full = store.read(indices)
        assert full.activation[0].shape == (3, MAX_LEN, DIM)
        assert torch.equal(full.activation[0][:, :6], hidden)
        assert not full.activation[0][:, 6:].any() and not full.activation[1][:, 6:].any()

        lookup = store.lookup(torch.arange(NUM_SAMPLES))
        assert lookup.dtype == torch.int32
        assert set(lookup.tolist()) == {EMPTY_BOUNDARY, 2}
        assert (lookup == 2).nonzero().reshape(-1).tolist() == [1, 4, 7]


def test_image_records_round_trip() -> None:
    example = (torch.randn(2, IMAGE_TOKENS, DIM),)
    spec = spec_from_activation(example)
    assert spec.shapes == ((IMAGE_TOKENS, DIM),)
    with ActivationStore.create(NUM_SAMPLES, spec, LOOSE_BUDGET) as store:
        store.unlink_names()
        store.write(torch.tensor([3, 0]), example, boundary=1)
        read = store.read(torch.tensor([0, 3, 5]))
        assert read.served.tolist() == [True, True, False]
        assert torch.equal(read.activation[0][:2], example[0].flip(0))
        assert not read.activation[0][2].any()


def test_rewrite_at_a_later_boundary_replaces_the_record() -> None:
    with ActivationStore.create(NUM_SAMPLES, TEXT_SPEC, LOOSE_BUDGET) as store:
        store.unlink_names()
        indices = torch.tensor([2, 3])
        store.write(indices, _text_batch(2, MAX_LEN, seed=1), boundary=1)
        newer = _text_batch(2, 5, seed=2)
        store.write(indices, newer, boundary=3)
        read = store.read(indices, trim_to=MAX_LEN)
        assert read.boundaries.tolist() == [3, 3]
        assert torch.equal(read.activation[0][:, :5], newer[0])
        assert not read.activation[0][:, 5:].any()


def test_tiny_memory_budget_spills_to_disk(tmp_path: Path) -> None:
    in_memory = 3
    budget = _memory_bytes_for(in_memory)
    with ActivationStore.create(NUM_SAMPLES, TEXT_SPEC, budget, tmp_path) as store:
        layout = store.layout
        assert layout.memory_records == in_memory
        assert layout.disk_records == NUM_SAMPLES - in_memory
        assert layout.memory_path is not None and layout.disk_path is not None
        assert os.stat(layout.memory_path).st_size <= budget
        store.unlink_names()
        indices = torch.randperm(NUM_SAMPLES, generator=torch.Generator().manual_seed(3))
        activation = _text_batch(NUM_SAMPLES, MAX_LEN, seed=4)
        store.write(indices, activation, boundary=5)
        read = store.read(indices, trim_to=MAX_LEN)
        assert read.served.all()
        assert torch.equal(read.activation[0], activation[0])
        assert torch.equal(read.activation[1], activation[1])
        stats = store.stats()
        assert stats.memory_used_bytes == in_memory * TEXT_SPEC.bytes_per_sample
        assert stats.disk_used_bytes == (NUM_SAMPLES - in_memory) * TEXT_SPEC.bytes_per_sample
        assert stats.hits == NUM_SAMPLES and stats.misses == 0 and stats.corrupt == 0


def test_without_disk_the_rest_is_uncacheable() -> None:
    with ActivationStore.create(NUM_SAMPLES, TEXT_SPEC, _memory_bytes_for(2)) as store:
        store.unlink_names()
        stored = store.write(torch.tensor([0, 1, 2, 9]), _text_batch(4, MAX_LEN, seed=5), boundary=1)
        assert stored.tolist() == [True, True, False, False]
        assert store.lookup(torch.tensor([0, 1, 2, 9])).tolist() == [1, 1, EMPTY_BOUNDARY, EMPTY_BOUNDARY]
        assert store.stats().uncacheable_writes == 2


def test_corrupt_disk_record_is_a_miss_never_served(tmp_path: Path) -> None:
    with ActivationStore.create(NUM_SAMPLES, TEXT_SPEC, _memory_bytes_for(0), tmp_path) as store:
        indices = torch.tensor([4, 6])
        store.write(indices, _text_batch(2, MAX_LEN, seed=6), boundary=2)
        extents = store.record_extents(6)
        assert extents is not None and extents[0].path == store.layout.disk_path
        with open(extents[0].path, "r+b") as disk_file:
            disk_file.seek(extents[0].offset + 1)
            original = disk_file.read(1)
            disk_file.seek(extents[0].offset + 1)
            disk_file.write(bytes([original[0] ^ 0xFF]))
        store.unlink_names()
        read = store.read(indices)
        assert read.served.tolist() == [True, False]
        assert not read.activation[0][1].any()
        assert store.stats().corrupt == 1
        assert store.lookup(indices).tolist() == [2, EMPTY_BOUNDARY]


def test_files_are_owner_only_unique_and_removed(tmp_path: Path) -> None:
    first = ActivationStore.create(NUM_SAMPLES, TEXT_SPEC, _memory_bytes_for(1), tmp_path)
    second = ActivationStore.create(NUM_SAMPLES, TEXT_SPEC, _memory_bytes_for(1), tmp_path)
    paths = [p for s in (first, second) for p in (s.layout.memory_path, s.layout.disk_path)]
    assert all(p is not None for p in paths) and len(set(paths)) == len(paths)
    for path in paths:
        assert path is not None
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert Path(path).name.startswith(FILE_PREFIX)
    first.unlink_names()
    assert not any(os.path.exists(p) for p in paths[:2] if p is not None)
    first.write(torch.tensor([0, 5]), _text_batch(2, MAX_LEN, seed=7), boundary=1)
    assert first.read(torch.tensor([0, 5])).served.all()
    second.close()
    assert not any(os.path.exists(p) for p in paths[2:] if p is not None)
    first.close()


def test_attached_store_shares_records_and_late_attach_is_refused() -> None:
    with ActivationStore.create(NUM_SAMPLES, TEXT_SPEC, LOOSE_BUDGET) as leader:
        follower = ActivationStore.attach(leader.layout)
        leader.unlink_names()
        activation = _text_batch(2, MAX_LEN, seed=8)
        follower.write(torch.tensor([1, 8]), activation, boundary=4)
        read = leader.read(torch.tensor([8, 1]))
        assert torch.equal(read.activation[0], activation[0].flip(0))
        with pytest.raises(FileNotFoundError, match="unlink_names"):
            ActivationStore.attach(leader.layout)
        follower.close()


def test_invalid_arguments_say_what_to_change() -> None:
    with pytest.raises(ValueError, match="at least"):
        ActivationStore.create(NUM_SAMPLES, TEXT_SPEC, memory_bytes=8)
    with ActivationStore.create(NUM_SAMPLES, TEXT_SPEC, LOOSE_BUDGET) as store:
        store.unlink_names()
        with pytest.raises(ValueError, match="spec_from_activation"):
            store.write(torch.tensor([0]), _text_batch(1, MAX_LEN + 1, seed=9), boundary=1)
        with pytest.raises(IndexError, match="dataset's size"):
            store.lookup(torch.tensor([NUM_SAMPLES]))
        with pytest.raises(ValueError, match="twice"):
            store.write(torch.tensor([1, 1]), _text_batch(2, MAX_LEN, seed=10), boundary=1)


_PROBE = """
import json, logging, signal, sys, torch
from pipetransformer.cache.store import ActivationStore
from pipetransformer.models.blocks import ActivationSpec
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
spec = ActivationSpec(shapes=(({max_len}, {dim}), ({max_len},)), dtypes=(torch.float32, torch.int64))
store = ActivationStore.create({samples}, spec, {memory_bytes}, sys.argv[1])
store.unlink_names()
hidden = torch.ones({samples}, {max_len}, {dim})
mask = torch.ones({samples}, {max_len}, dtype=torch.int64)
stored = store.write(torch.arange({samples}), (hidden, mask), boundary=1)
served = store.read(torch.arange({samples})).served
print(json.dumps(dict(disk=store.layout.disk_path, stored=stored.tolist(), served=served.tolist())))
store.close()
"""


def _probe_unwritable_disk(disk_dir: str, as_plain_user: bool, file_size_limit: int | None) -> tuple[dict, str]:
    """Create a store in a child process (so limits and user changes stay there)."""
    import resource

    def limit() -> None:
        if file_size_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    code = _PROBE.format(max_len=MAX_LEN, dim=DIM, samples=NUM_SAMPLES, memory_bytes=_memory_bytes_for(2))
    prefix = DROP_FILE_PERMISSION_OVERRIDES if as_plain_user else []
    result = subprocess.run(
        [*prefix, sys.executable, "-c", code, disk_dir],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), result.stderr


@pytest.mark.parametrize("failure", ["read_only", "full"])
def test_unwritable_disk_turns_level_two_off_with_one_warning(failure: str) -> None:
    workdir = tempfile.mkdtemp(prefix="pipetransformer-test-")
    try:
        disk_dir = workdir
        if failure == "read_only":
            os.chmod(workdir, 0o555)
        as_plain_user = failure == "read_only" and os.geteuid() == 0
        if as_plain_user and shutil.which(DROP_FILE_PERMISSION_OVERRIDES[0]) is None:
            pytest.skip("running as root without setpriv: cannot make a directory read-only for root")
        limit = FILE_SIZE_LIMIT if failure == "full" else None
        outcome, stderr = _probe_unwritable_disk(disk_dir, as_plain_user, limit)
    finally:
        os.chmod(workdir, 0o700)
        shutil.rmtree(workdir)
    assert outcome["disk"] is None
    assert outcome["stored"] == [True, True] + [False] * (NUM_SAMPLES - 2)
    assert outcome["served"] == outcome["stored"]
    assert stderr.count("disk level disabled") == 1, stderr


def test_disk_failure_warns_through_logging(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"")
    with caplog.at_level(logging.WARNING), ActivationStore.create(
        NUM_SAMPLES, TEXT_SPEC, _memory_bytes_for(1), not_a_dir / "cache"
    ) as store:
        store.unlink_names()
        assert store.layout.disk_records == 0
    assert sum("disk level disabled" in r.getMessage() for r in caplog.records) == 1


class _RewriteBetweenTensors(list):  # type: ignore[type-arg]
    """A level's per-tensor regions that let another worker rewrite the record while a read is between them."""

    def __init__(self, regions: list[torch.Tensor], rewrite: Callable[[], None]) -> None:
        super().__init__(regions)
        self._rewrite = rewrite

    def __iter__(self) -> Iterator[torch.Tensor]:
        for position, region in enumerate(list.__iter__(self)):
            if position == 1:
                self._rewrite()
            yield region


def test_a_record_rewritten_at_the_same_boundary_during_a_read_is_a_miss_not_torn() -> None:
    with ActivationStore.create(NUM_SAMPLES, TEXT_SPEC, LOOSE_BUDGET) as reader:
        writer = ActivationStore.attach(reader.layout)
        reader.unlink_names()
        old, new = _text_batch(1, MAX_LEN, seed=20), _text_batch(1, MAX_LEN, seed=21)
        reader.write(torch.tensor([3]), old, boundary=2)
        level = reader._memory  # noqa: SLF001 - the read's copy loop, to interleave a write deterministically
        level.tensors = _RewriteBetweenTensors(level.tensors, lambda: writer.write(torch.tensor([3]), new, boundary=2))
        read = reader.read(torch.tensor([3]))
        assert not read.served.any(), "served the old record's hidden states with the new record's mask"
        level.tensors = list(level.tensors)
        again = reader.read(torch.tensor([3]))
        assert again.served.all() and torch.equal(again.activation[0], new[0])
        writer.close()


def test_bfloat16_records_spill_to_disk_and_read_back_bit_exact(tmp_path: Path) -> None:
    """The disk level's checksum covers a record's raw bytes, whatever its dtype (numpy has no bfloat16)."""
    activation = tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in _text_batch(3, MAX_LEN, seed=22))
    spec = spec_from_activation(activation)
    with ActivationStore.create(NUM_SAMPLES, spec, _memory_bytes_for(0), tmp_path) as store:
        store.unlink_names()
        indices = torch.tensor([2, 5, 9])
        store.write(indices, activation, boundary=1)
        read = store.read(indices)
        assert read.served.all() and store.stats().disk_used_bytes > 0
        assert all(torch.equal(got, want) for got, want in zip(read.activation, activation, strict=True))


LEADER_KILLED_BEFORE_UNLINK = """
import os, signal, sys, torch
from pipetransformer.cache.store import ActivationStore
from pipetransformer.models.blocks import ActivationSpec
spec = ActivationSpec(shapes=((8, 4), (8,)), dtypes=(torch.float32, torch.int64))
store = ActivationStore.create(10, spec, 600, disk_dir=sys.argv[2], shm_dir=sys.argv[1])  # most on disk
print(store.layout.memory_path, store.layout.disk_path, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # after create, before unlink_names
"""


def test_regions_of_a_leader_killed_before_unlinking_are_removed_by_the_next_run(tmp_path: Path) -> None:
    shm, disk = tmp_path / "shm", tmp_path / "disk"
    shm.mkdir()
    with ActivationStore.create(NUM_SAMPLES, TEXT_SPEC, _memory_bytes_for(1), disk, shm_dir=shm) as alive:
        killed = subprocess.run([sys.executable, "-c", LEADER_KILLED_BEFORE_UNLINK, str(shm), str(disk)],
                                capture_output=True, text=True, timeout=120)
        assert killed.returncode == -9, killed.stderr[-2000:]
        stale = killed.stdout.split()
        assert len(stale) == 2 and all(os.path.exists(p) for p in stale)
        with ActivationStore.create(NUM_SAMPLES, TEXT_SPEC, _memory_bytes_for(1), disk, shm_dir=shm) as later:
            assert not any(os.path.exists(p) for p in stale), "the dead leader's regions are still there"
            live = [alive.layout.memory_path, alive.layout.disk_path, later.layout.memory_path, later.layout.disk_path]
            assert all(p is not None and os.path.exists(p) for p in live), "a live process's region was removed"


def test_the_suite_watches_where_the_store_writes() -> None:
    """conftest's leak check spells the store's prefix and directory out; a rename here would blind it."""
    from conftest import CACHE_PREFIX, SHM

    assert (CACHE_PREFIX, SHM) == (FILE_PREFIX, DEFAULT_SHM_DIR)
