"""Test-suite-wide checks: nothing may be left in /dev/shm by any test."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "integration"))

SHM = Path("/dev/shm")
CACHE_PREFIX = "pipetransformer-cache-"


def _ours() -> set[str]:
    return {p.name for p in SHM.glob(CACHE_PREFIX + "*")} if SHM.is_dir() else set()


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind() -> Iterator[None]:
    before = _ours()
    yield
    left = _ours() - before
    assert not left, f"tests left files in /dev/shm: {sorted(left)}"
