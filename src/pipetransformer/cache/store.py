"""Per-sample activation records in host shared memory, spilling to a memory-mapped disk file.

One record per dataset sample index holds that sample's activation at some block boundary, padded to
fixed per-sample shapes, so any local worker can read any sample without asking its writer. Level 1
is a file in ``/dev/shm`` every local worker maps; level 2 is a file in ``disk_dir`` for the samples
that do not fit, each disk record guarded by a CRC32 so a corrupt record is a miss, never served.

Sample ``i`` has a fixed home: level 1 slot ``i`` if ``i < memory_records``, else level 2 slot
``i - memory_records``, else nowhere (uncacheable). Fixed homes need no cross-process allocator.

Lifecycle (the distributed trainer puts a barrier between the steps)::

    store = ActivationStore.create(...)   # local leader: creates owner-only, uniquely named files
    store = ActivationStore.attach(layout) # every other local worker, with the leader's layout
    store.unlink_names()                   # leader, once all have attached: nothing is left behind,
                                           # even on SIGKILL, because the mappings outlive the names

Concurrency: data-parallel workers write disjoint sample indices. Each record has a sequence number
(a seqlock): a write makes it odd, marks the record empty, writes the payload and its boundary, then
makes it even again; a read serves a record only if its sequence number was even and unchanged across
the copy (and its boundary set), so a record being rewritten is a miss, never torn data, even when the
rewrite is at the same boundary.

Files are named ``<FILE_PREFIX><pid>-<start time>-<random>``: a leader killed between creating them and
unlinking their names leaves them behind, and the next leader on the node removes those whose creator
is gone (:func:`remove_stale_files`).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import weakref
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from pipetransformer.models.blocks import Activation, ActivationSpec

__all__ = [
    "DEFAULT_SHM_DIR",
    "EMPTY_BOUNDARY",
    "FILE_PREFIX",
    "ActivationStore",
    "RecordExtent",
    "StoreLayout",
    "StoreRead",
    "StoreStats",
    "remove_stale_files",
    "spec_from_activation",
]

logger = logging.getLogger(__name__)

FILE_PREFIX = "pipetransformer-cache-"
"""Every file the store creates starts with this, then a per-run random token."""
DEFAULT_SHM_DIR = Path("/dev/shm")
EMPTY_BOUNDARY = -1
"""Boundary value of a record that holds nothing."""

_FILE_MODE = 0o600
_NAME_TOKEN_BYTES = 8
_REGION_ALIGNMENT = 64
_SHM_FREE_FRACTION = 0.5
"""Use at most this share of the free space in /dev/shm: DataLoader workers and torch IPC need it too."""
_MEMORY_SUFFIX = ".mem"
_DISK_SUFFIX = ".disk"
_BOUNDARY_DTYPE = torch.int32
_CHECKSUM_DTYPE = torch.int64
_SEQUENCE_DTYPE = torch.int64
_PROC = Path("/proc")
_START_TIME_FIELD = 22
"""A process's start time (clock ticks since boot) is field 22 of ``/proc/<pid>/stat`` (man 5 proc)."""
_FIELDS_UP_TO_COMMAND = 2  # pid and (command name), which may hold spaces


def spec_from_activation(example: Activation, pad_to: int | None = None) -> ActivationSpec:
    """Per-sample spec of a batched activation; ``pad_to`` fixes the sequence length (text)."""
    shapes: list[tuple[int, ...]] = []
    for tensor in example:
        shape = tuple(tensor.shape[1:])
        if pad_to is not None:
            shape = (pad_to, *shape[1:])
        shapes.append(shape)
    return ActivationSpec(shapes=tuple(shapes), dtypes=tuple(t.dtype for t in example))


@dataclass(frozen=True)
class StoreLayout:
    """Everything a worker needs to attach to the leader's store; sent to the others as JSON (never pickled)."""

    name: str
    num_samples: int
    spec: ActivationSpec
    memory_path: str | None
    memory_records: int
    disk_path: str | None
    disk_records: int

    @property
    def enabled(self) -> bool:
        return self.memory_path is not None

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "num_samples": self.num_samples,
                           "shapes": [list(s) for s in self.spec.shapes],
                           "dtypes": [str(d).removeprefix("torch.") for d in self.spec.dtypes],
                           "memory_path": self.memory_path, "memory_records": self.memory_records,
                           "disk_path": self.disk_path, "disk_records": self.disk_records})

    @classmethod
    def from_json(cls, text: str) -> StoreLayout:
        values = json.loads(text)
        spec = ActivationSpec(tuple(tuple(s) for s in values["shapes"]),
                              tuple(getattr(torch, d) for d in values["dtypes"]))
        return cls(values["name"], values["num_samples"], spec, values["memory_path"], values["memory_records"],
                   values["disk_path"], values["disk_records"])


class StoreRead(NamedTuple):
    """A batched read: rows not ``served`` hold zeros and must be recomputed."""

    activation: Activation
    boundaries: torch.Tensor
    served: torch.Tensor


class RecordExtent(NamedTuple):
    """Where one tensor of one record lies in its file (for debugging and corruption tests)."""

    path: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class StoreStats:
    """Counters of this process plus the fill of the shared levels."""

    hits: int
    misses: int
    corrupt: int
    writes: int
    uncacheable_writes: int
    memory_bytes: int
    disk_bytes: int
    memory_used_bytes: int
    disk_used_bytes: int


def _align(offset: int) -> int:
    return -(-offset // _REGION_ALIGNMENT) * _REGION_ALIGNMENT


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


def _tensor_offsets(spec: ActivationSpec, capacity: int, start: int) -> tuple[list[int], int]:
    """Offsets of each tensor's ``[capacity, *shape]`` region from ``start``, and the end offset."""
    offsets: list[int] = []
    offset = start
    for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
        offset = _align(offset)
        offsets.append(offset)
        offset += capacity * _numel(shape) * _element_size(dtype)
    return offsets, offset


def _header_offsets(num_samples: int) -> tuple[int, int, int, int]:
    """Offsets of the boundary, checksum and sequence-number arrays in the memory file, and the header's end."""
    boundary_offset = 0
    checksum_offset = _align(num_samples * _element_size(_BOUNDARY_DTYPE))
    sequence_offset = _align(checksum_offset + num_samples * _element_size(_CHECKSUM_DTYPE))
    return boundary_offset, checksum_offset, sequence_offset, sequence_offset + num_samples * _element_size(
        _SEQUENCE_DTYPE)


def _memory_file_bytes(num_samples: int, spec: ActivationSpec, records: int) -> int:
    return _tensor_offsets(spec, records, _header_offsets(num_samples)[3])[1]


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), or None if there is no such process."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[_START_TIME_FIELD - _FIELDS_UP_TO_COMMAND - 1]


def _file_name_prefix() -> str:
    """This process's files: its pid and start time, so a later run can tell whether their creator still runs."""
    pid = os.getpid()
    return f"{FILE_PREFIX}{pid}-{_start_time(pid)}-"


def remove_stale_files(directory: str | Path) -> list[str]:
    """Remove this user's store files in ``directory`` whose creator is no longer running (a leader killed
    before it unlinked them); returns their paths. A pid now used by another process does not keep them:
    the creator's start time must match too."""
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(FILE_PREFIX):
            continue
        pid, _, rest = entry.name.removeprefix(FILE_PREFIX).partition("-")
        started = rest.partition("-")[0]
        try:
            if not pid.isdigit() or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            if _start_time(int(pid)) == started:
                continue
            os.unlink(entry.path)
        except OSError:
            continue
        removed.append(entry.path)
    if removed:
        logger.warning("AutoCache: removed %d files of cache stores whose process died: %s", len(removed),
                       ", ".join(removed))
    return removed


def _create_file(path: str, nbytes: int) -> None:
    """Create an owner-only file and reserve its blocks, so a full device fails here, not as SIGBUS later."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _FILE_MODE)
    try:
        os.fchmod(fd, _FILE_MODE)
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)


def _unlink_paths(paths: Sequence[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _map(path: str, nbytes: int) -> torch.Tensor:
    """Map an existing file; never creates one (``torch.from_file`` would, given a vanished name)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"cache file {path} is gone: attach every worker before the leader calls unlink_names()"
        ) from None
    try:
        if os.fstat(fd).st_size < nbytes:
            raise ValueError(f"cache file {path} is smaller than its layout says; attach with the leader's layout")
        return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
    finally:
        os.close(fd)


def _views(buffer: torch.Tensor, spec: ActivationSpec, capacity: int, offsets: list[int]) -> list[torch.Tensor]:
    views: list[torch.Tensor] = []
    for shape, dtype, offset in zip(spec.shapes, spec.dtypes, offsets, strict=True):
        nbytes = capacity * _numel(shape) * _element_size(dtype)
        views.append(buffer[offset : offset + nbytes].view(dtype).view(capacity, *shape))
    return views


@dataclass
class _Level:
    path: str | None
    first_index: int
    capacity: int
    tensors: list[torch.Tensor]
    offsets: list[int]
    nbytes: int


class ActivationStore:
    """Fixed-size per-sample activation records shared by the local workers of one run."""

    def __init__(self, layout: StoreLayout, owner: bool) -> None:
        """Map ``layout``'s files; use :meth:`create` or :meth:`attach` instead of calling this."""
        self._layout = layout
        self._hits = 0
        self._misses = 0
        self._corrupt = 0
        self._writes = 0
        self._uncacheable_writes = 0
        paths = [p for p in (layout.memory_path, layout.disk_path) if p is not None]
        self._unlinker = weakref.finalize(self, _unlink_paths, paths if owner else [])
        n = layout.num_samples
        if layout.memory_path is None:
            self._boundary = torch.full((n,), EMPTY_BOUNDARY, dtype=_BOUNDARY_DTYPE)
            self._checksum = torch.zeros((n,), dtype=_CHECKSUM_DTYPE)
            self._sequence = torch.zeros((n,), dtype=_SEQUENCE_DTYPE)
            self._memory = _Level(None, 0, 0, [], [], 0)
            self._disk = _Level(None, 0, 0, [], [], 0)
            return
        nbytes = _memory_file_bytes(n, layout.spec, layout.memory_records)
        buffer = _map(layout.memory_path, nbytes)
        boundary_offset, checksum_offset, sequence_offset, header_end = _header_offsets(n)
        self._boundary = buffer[boundary_offset : boundary_offset + n * _element_size(_BOUNDARY_DTYPE)].view(
            _BOUNDARY_DTYPE
        )
        self._checksum = buffer[checksum_offset : checksum_offset + n * _element_size(_CHECKSUM_DTYPE)].view(
            _CHECKSUM_DTYPE
        )
        self._sequence = buffer[sequence_offset : sequence_offset + n * _element_size(_SEQUENCE_DTYPE)].view(
            _SEQUENCE_DTYPE
        )
        offsets = _tensor_offsets(layout.spec, layout.memory_records, header_end)[0]
        self._memory = _Level(
            layout.memory_path,
            0,
            layout.memory_records,
            _views(buffer, layout.spec, layout.memory_records, offsets),
            offsets,
            nbytes,
        )
        self._disk = _Level(None, layout.memory_records, 0, [], [], 0)
        if layout.disk_path is not None:
            offsets, disk_bytes = _tensor_offsets(layout.spec, layout.disk_records, 0)
            disk_buffer = _map(layout.disk_path, disk_bytes)
            self._disk = _Level(
                layout.disk_path,
                layout.memory_records,
                layout.disk_records,
                _views(disk_buffer, layout.spec, layout.disk_records, offsets),
                offsets,
                disk_bytes,
            )

    @classmethod
    def create(
        cls,
        num_samples: int,
        spec: ActivationSpec,
        memory_bytes: int,
        disk_dir: str | Path | None = None,
        shm_dir: str | Path = DEFAULT_SHM_DIR,
    ) -> ActivationStore:
        """Create the run's files (local leader only); broadcast ``store.layout`` to the others.

        At most ``memory_bytes`` (and at most half the free space) is taken in ``shm_dir``, index
        arrays included; the other samples go to ``disk_dir``. A disk level that cannot be created
        is turned off with one warning and its samples become uncacheable.
        """
        if num_samples <= 0:
            raise ValueError(f"num_samples={num_samples}: the cache needs a dataset with at least one sample")
        header = _header_offsets(num_samples)[3]
        if memory_bytes < header:
            raise ValueError(
                f"cache memory_bytes={memory_bytes} cannot hold the index of {num_samples} samples; "
                f"set it to at least {header}"
            )
        for directory in (shm_dir, disk_dir):
            if directory is not None:
                remove_stale_files(directory)
        name = _file_name_prefix() + secrets.token_hex(_NAME_TOKEN_BYTES)
        budget = min(memory_bytes, int(shutil.disk_usage(shm_dir).free * _SHM_FREE_FRACTION))
        memory_records = max(0, min(num_samples, (budget - header) // max(1, spec.bytes_per_sample)))
        while memory_records > 0 and _memory_file_bytes(num_samples, spec, memory_records) > budget:
            memory_records -= 1
        if budget < min(memory_bytes, _memory_file_bytes(num_samples, spec, num_samples)):
            logger.warning(
                "AutoCache: %s has room for %d of %d samples only; the rest go to disk",
                shm_dir,
                memory_records,
                num_samples,
            )
        memory_path = str(Path(shm_dir) / (name + _MEMORY_SUFFIX))
        try:
            _create_file(memory_path, _memory_file_bytes(num_samples, spec, memory_records))
        except OSError as error:
            logger.warning("AutoCache disabled: cannot create %s (%s); every sample is recomputed", memory_path, error)
            return cls(StoreLayout(name, num_samples, spec, None, 0, None, 0), owner=True)
        disk_records = num_samples - memory_records if disk_dir is not None else 0
        disk_path: str | None = None
        if disk_records > 0 and disk_dir is not None:
            disk_path = str(Path(disk_dir) / (name + _DISK_SUFFIX))
            try:
                Path(disk_dir).mkdir(parents=True, exist_ok=True)
                _create_file(disk_path, _tensor_offsets(spec, disk_records, 0)[1])
            except OSError as error:
                logger.warning(
                    "AutoCache disk level disabled: cannot create %s (%s); %d samples will not be cached",
                    disk_path,
                    error,
                    disk_records,
                )
                disk_path, disk_records = None, 0
        layout = StoreLayout(name, num_samples, spec, memory_path, memory_records, disk_path, disk_records)
        try:
            store = cls(layout, owner=True)
        except BaseException:
            _unlink_paths([p for p in (memory_path, disk_path) if p is not None])
            raise
        store._boundary.fill_(EMPTY_BOUNDARY)
        return store

    @classmethod
    def attach(cls, layout: StoreLayout) -> ActivationStore:
        """Map the leader's files (every non-leader local worker, before the leader unlinks them)."""
        return cls(layout, owner=False)

    @property
    def layout(self) -> StoreLayout:
        return self._layout

    @property
    def enabled(self) -> bool:
        return self._layout.enabled

    def unlink_names(self) -> None:
        """Remove the files' names once every local worker has mapped them (leader only; idempotent)."""
        self._unlinker()

    def close(self) -> None:
        """Unmap; the creator also removes the names if :meth:`unlink_names` was not called."""
        self._unlinker()
        self._memory = _Level(None, 0, 0, [], [], 0)
        self._disk = _Level(None, self._layout.memory_records, 0, [], [], 0)
        self._boundary = torch.full((self._layout.num_samples,), EMPTY_BOUNDARY, dtype=_BOUNDARY_DTYPE)
        self._checksum = torch.zeros((self._layout.num_samples,), dtype=_CHECKSUM_DTYPE)
        self._sequence = torch.zeros((self._layout.num_samples,), dtype=_SEQUENCE_DTYPE)

    def __enter__(self) -> ActivationStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_indices(self, indices: torch.Tensor) -> torch.Tensor:
        idx = indices.reshape(-1).to(torch.long)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self._layout.num_samples):
            raise IndexError(
                f"sample indices must lie in [0, {self._layout.num_samples}); create the store with the dataset's size"
            )
        return idx

    def _levels(self, idx: torch.Tensor) -> list[tuple[_Level, torch.Tensor, torch.Tensor]]:
        """For each level: the rows of ``idx`` it holds and their slots in it."""
        found: list[tuple[_Level, torch.Tensor, torch.Tensor]] = []
        for level in (self._memory, self._disk):
            if level.capacity == 0:
                continue
            inside = (idx >= level.first_index) & (idx < level.first_index + level.capacity)
            rows = inside.nonzero().reshape(-1)
            if rows.numel():
                found.append((level, rows, idx[rows] - level.first_index))
        return found

    def _record_checksum(self, level: _Level, slot: int) -> int:
        """CRC32 of the record's raw bytes, whatever its dtypes (numpy knows no bfloat16)."""
        checksum = 0
        for region in level.tensors:
            checksum = zlib.crc32(region[slot].reshape(-1).view(torch.uint8).numpy(), checksum)
        return checksum

    def lookup(self, indices: torch.Tensor) -> torch.Tensor:
        """Boundary of each sample's record (int32; ``EMPTY_BOUNDARY`` if none)."""
        return self._boundary[self._check_indices(indices)]

    def read(self, indices: torch.Tensor, trim_to: int | None = None) -> StoreRead:
        """Gather the records of ``indices``, cut to the first ``trim_to`` positions (text)."""
        idx = self._check_indices(indices)
        spec = self._layout.spec
        sequence = self._sequence[idx]
        before = self._boundary[idx]
        tensors: list[torch.Tensor] = []
        for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
            length = shape[0] if trim_to is None else min(trim_to, shape[0])
            tensors.append(torch.zeros((idx.numel(), length, *shape[1:]), dtype=dtype))
        intact = torch.ones(idx.numel(), dtype=torch.bool)
        for level, rows, slots in self._levels(idx):
            for out, region in zip(tensors, level.tensors, strict=True):
                out[rows] = region[:, : out.shape[1]].index_select(0, slots)
            if level is self._disk:
                for row, slot in zip(rows.tolist(), slots.tolist(), strict=True):
                    if before[row] == EMPTY_BOUNDARY:
                        continue
                    if self._record_checksum(level, slot) != int(self._checksum[idx[row]]):
                        intact[row] = False
        after = self._boundary[idx]
        stable = (sequence % 2 == 0) & (self._sequence[idx] == sequence)
        served = (before != EMPTY_BOUNDARY) & (before == after) & stable & intact
        corrupt = (~intact).nonzero().reshape(-1)
        if corrupt.numel():
            self._corrupt += corrupt.numel()
            logger.warning("AutoCache: %d corrupt disk records recomputed", corrupt.numel())
            self._boundary[idx[corrupt]] = EMPTY_BOUNDARY
        for out in tensors:
            out[~served] = 0
        hits = int(served.sum())
        self._hits += hits
        self._misses += idx.numel() - hits
        return StoreRead(tuple(tensors), before, served)

    def write(self, indices: torch.Tensor, activation: Activation, boundary: int) -> torch.Tensor:
        """Store each sample's activation (padded to the fixed shapes) as the output of ``boundary``.

        Returns which rows were stored; samples with no home in either level are dropped.
        """
        idx = self._check_indices(indices)
        self._check_activation(idx, activation)
        if boundary < 0:
            raise ValueError(f"boundary={boundary}: a record is the output of a block, so it must be >= 0")
        if torch.unique(idx).numel() != idx.numel():
            raise ValueError("write() got a sample index twice; give each sample once per write")
        stored = torch.zeros(idx.numel(), dtype=torch.bool)
        levels = self._levels(idx)
        for _, rows, _ in levels:
            stored[rows] = True
        homed = idx[stored]
        self._sequence[homed] += 1  # odd: being written
        self._boundary[homed] = EMPTY_BOUNDARY
        for level, rows, slots in levels:
            for value, region in zip(activation, level.tensors, strict=True):
                length = value.shape[1]  # a device's activation is copied to the host memory the store maps
                region[:, :length].index_copy_(0, slots, value.index_select(0, rows.to(value.device)).to(
                    device=region.device, dtype=region.dtype))
                region[:, length:].index_fill_(0, slots, 0)
            if level is self._disk:
                for row, slot in zip(rows.tolist(), slots.tolist(), strict=True):
                    self._checksum[idx[row]] = self._record_checksum(level, slot)
        self._boundary[homed] = boundary
        self._sequence[homed] += 1  # even: stable
        self._writes += homed.numel()
        self._uncacheable_writes += idx.numel() - homed.numel()
        return stored

    def _check_activation(self, idx: torch.Tensor, activation: Activation) -> None:
        spec = self._layout.spec
        if len(activation) != len(spec.shapes):
            raise ValueError(f"activation has {len(activation)} tensors, the store was created for {len(spec.shapes)}")
        for value, shape, dtype in zip(activation, spec.shapes, spec.dtypes, strict=True):
            fits = (
                value.dtype == dtype
                and value.dim() == len(shape) + 1
                and value.shape[0] == idx.numel()
                and value.shape[1] <= shape[0]
                and tuple(value.shape[2:]) == tuple(shape[1:])
            )
            if not fits:
                raise ValueError(
                    f"activation tensor {tuple(value.shape)} {value.dtype} does not fit records of "
                    f"{shape} {dtype} for {idx.numel()} samples; create the store with spec_from_activation()"
                )

    def record_extents(self, index: int) -> list[RecordExtent] | None:
        """File, offset and size of each tensor of sample ``index``'s record (None if it has no home)."""
        for level in (self._memory, self._disk):
            slot = index - level.first_index
            if level.path is not None and 0 <= slot < level.capacity:
                extents: list[RecordExtent] = []
                for region, offset in zip(level.tensors, level.offsets, strict=True):
                    nbytes = region[0].numel() * region.element_size()
                    extents.append(RecordExtent(level.path, offset + slot * nbytes, nbytes))
                return extents
        return None

    def stats(self) -> StoreStats:
        filled = self._boundary != EMPTY_BOUNDARY
        record_bytes = self._layout.spec.bytes_per_sample
        memory_cap = self._memory.capacity
        disk_filled = filled[self._disk.first_index : self._disk.first_index + self._disk.capacity]
        return StoreStats(
            hits=self._hits,
            misses=self._misses,
            corrupt=self._corrupt,
            writes=self._writes,
            uncacheable_writes=self._uncacheable_writes,
            memory_bytes=self._memory.nbytes,
            disk_bytes=self._disk.nbytes,
            memory_used_bytes=int(filled[:memory_cap].sum()) * record_bytes,
            disk_used_bytes=int(disk_filled.sum()) * record_bytes,
        )
