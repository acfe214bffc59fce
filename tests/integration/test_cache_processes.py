"""ActivationStore across real processes: shared records, and nothing left behind after SIGKILL."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from multiprocessing.context import SpawnContext, SpawnProcess
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path

import pytest
import torch

from pipetransformer.cache.store import DEFAULT_SHM_DIR, ActivationStore, StoreLayout
from pipetransformer.models.blocks import Activation, ActivationSpec

pytestmark = pytest.mark.slow

NUM_SAMPLES = 16
MAX_LEN = 6
DIM = 4
MEMORY_RECORDS = 5
WAIT_SECONDS = 120.0
SPEC = ActivationSpec(shapes=((MAX_LEN, DIM), (MAX_LEN,)), dtypes=(torch.float32, torch.int64))
INDEX_BYTES = 448  # boundary, checksum and sequence arrays of 16 samples (320 bytes) + alignment of 2 regions
MEMORY_BYTES = INDEX_BYTES + MEMORY_RECORDS * SPEC.bytes_per_sample
WRITTEN = [0, 3, 4, 7, 12, 15]
LEADER_LOOP = [5, 6, 13]
"""Samples the leader keeps rewriting until it is killed: data-parallel workers write disjoint samples."""
BOUNDARY = 2



def _activation_for(indices: list[int]) -> Activation:
    """Deterministic per-sample content, so any process can tell what a record must hold."""
    rows = []
    for index in indices:
        generator = torch.Generator().manual_seed(index)
        rows.append(torch.randn(MAX_LEN, DIM, generator=generator))
    mask = torch.tensor([[1] * (1 + i % MAX_LEN) + [0] * (MAX_LEN - 1 - i % MAX_LEN) for i in indices])
    return torch.stack(rows), mask


def _leader(disk_dir: str, layouts: Queue, attached: Event, unlinked: Event, go: Event, loop: bool) -> None:
    store = ActivationStore.create(NUM_SAMPLES, SPEC, MEMORY_BYTES, disk_dir)
    layouts.put(store.layout)
    attached.wait(WAIT_SECONDS)
    store.unlink_names()
    unlinked.set()
    store.write(torch.tensor(WRITTEN), _activation_for(WRITTEN), BOUNDARY)
    go.set()
    while loop:
        store.write(torch.tensor(LEADER_LOOP), _activation_for(LEADER_LOOP), BOUNDARY)
    store.close()


def _follower(layout: StoreLayout, attached: Event, go: Event, stop: Event, results: Queue) -> None:
    store = ActivationStore.attach(layout)
    attached.set()
    go.wait(WAIT_SECONDS)
    read = store.read(torch.tensor(WRITTEN), trim_to=MAX_LEN)
    expected = _activation_for(WRITTEN)
    exact = all(torch.equal(got, want) for got, want in zip(read.activation, expected, strict=True))
    results.put({"served": bool(read.served.all()), "exact": exact})
    stop.wait(WAIT_SECONDS)
    mine = [1, 2]
    store.write(torch.tensor(mine), _activation_for(mine), BOUNDARY + 1)
    again = store.read(torch.tensor(mine))
    still_works = bool(again.served.all()) and torch.equal(again.activation[0], _activation_for(mine)[0])
    results.put({"still_works": still_works})
    store.close()


class _Run:
    """The two workers of one test, killed at the end whatever happens."""

    def __init__(self, disk_dir: Path, leader_loops: bool) -> None:
        self.context: SpawnContext = mp.get_context("spawn")
        self.layouts: Queue = self.context.Queue()
        self.results: Queue = self.context.Queue()
        self.attached, self.unlinked, self.go, self.stop = (self.context.Event() for _ in range(4))
        self.leader: SpawnProcess = self.context.Process(
            target=_leader,
            args=(str(disk_dir), self.layouts, self.attached, self.unlinked, self.go, leader_loops),
        )
        self.follower: SpawnProcess | None = None

    def start(self) -> StoreLayout:
        self.leader.start()
        layout: StoreLayout = self.layouts.get(timeout=WAIT_SECONDS)
        self.follower = self.context.Process(
            target=_follower, args=(layout, self.attached, self.go, self.stop, self.results)
        )
        self.follower.start()
        return layout

    def kill(self) -> None:
        for process in (self.leader, self.follower):
            if process is not None and process.is_alive():
                process.kill()
            if process is not None:
                process.join(WAIT_SECONDS)


def _leftovers(layout: StoreLayout, disk_dir: Path) -> list[str]:
    names = [n for n in os.listdir(DEFAULT_SHM_DIR) if n.startswith(layout.name)]
    return names + [n for n in os.listdir(disk_dir) if n.startswith(layout.name)]


def test_one_worker_writes_the_other_reads_bit_exact(tmp_path: Path) -> None:
    run = _Run(tmp_path, leader_loops=False)
    try:
        layout = run.start()
        assert layout.memory_records == MEMORY_RECORDS and layout.disk_records == NUM_SAMPLES - MEMORY_RECORDS
        assert run.results.get(timeout=WAIT_SECONDS) == {"served": True, "exact": True}
        run.stop.set()
        assert run.results.get(timeout=WAIT_SECONDS) == {"still_works": True}
        run.leader.join(WAIT_SECONDS)
        assert run.follower is not None
        run.follower.join(WAIT_SECONDS)
        assert run.leader.exitcode == 0 and run.follower.exitcode == 0
        assert _leftovers(layout, tmp_path) == []
    finally:
        run.kill()


def test_sigkilled_leader_mid_run_leaves_nothing_behind(tmp_path: Path) -> None:
    run = _Run(tmp_path, leader_loops=True)
    try:
        layout = run.start()
        assert run.results.get(timeout=WAIT_SECONDS) == {"served": True, "exact": True}
        assert run.leader.is_alive() and run.leader.pid is not None
        os.kill(run.leader.pid, signal.SIGKILL)
        run.leader.join(WAIT_SECONDS)
        assert run.leader.exitcode == -signal.SIGKILL
        assert _leftovers(layout, tmp_path) == []
        run.stop.set()
        assert run.results.get(timeout=WAIT_SECONDS) == {"still_works": True}
        assert run.follower is not None and run.follower.pid is not None
        os.kill(run.follower.pid, signal.SIGKILL)
        run.follower.join(WAIT_SECONDS)
        assert _leftovers(layout, tmp_path) == []
    finally:
        run.kill()
