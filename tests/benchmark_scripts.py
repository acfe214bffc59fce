"""Load a benchmark's ``main.py`` (a script beside ``benchmarks/common.py``, not a package) as a module for tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(folder: str) -> ModuleType:
    """``benchmarks/<folder>/main.py`` as the module ``<folder>_main``; importing it puts ``common`` in sys.modules."""
    name = f"{folder}_main"
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / folder / "main.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module
