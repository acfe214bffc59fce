"""Test-suite-wide checks: nothing may be left in /dev/shm by any test; CUDA tests run only where the GPUs are."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "integration"))

SHM = Path("/dev/shm")
CACHE_PREFIX = "pipetransformer-cache-"
"""``cache.store.FILE_PREFIX``, spelled out so that collecting the tests imports no torch (test_cache_store pins it)."""


def _ours() -> set[str]:
    return {p.name for p in SHM.glob(CACHE_PREFIX + "*")} if SHM.is_dir() else set()


@pytest.fixture(scope="module", autouse=True)
def no_shared_memory_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """Per test module, so a leak names the module that left it (the cache unlinks its regions once mapped)."""
    before = _ours()
    yield
    left = _ours() - before
    assert not left, f"{request.module.__name__} left files in /dev/shm: {sorted(left)}"


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``@pytest.mark.cuda(devices=N)``: skipped on machines with fewer CUDA devices (CI has none)."""
    marker = item.get_closest_marker("cuda")
    if marker is None:
        return
    import torch

    needed = int(marker.kwargs.get("devices", 1))
    if torch.cuda.device_count() < needed:
        pytest.skip(f"needs {needed} CUDA device(s), this machine has {torch.cuda.device_count()}")
