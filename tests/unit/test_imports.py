"""The pure modules import without torch: a config is checked and a layout planned before torch's seconds of import
are paid (by the launcher, ``plan --cluster`` on a preset, a reader of the planner). Each is imported in a fresh
interpreter, as a user's first import would be, not in this one, where torch is long loaded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PURE_MODULES = ["pipetransformer.config", "pipetransformer.pipe.cost", "pipetransformer.pipe.partition",
                "pipetransformer.pipe.layout", "pipetransformer.pipe.planner", "pipetransformer.plan.cluster",
                "pipetransformer.plan.model_spec", "pipetransformer.plan.simulate", "pipetransformer.plan.levers",
                "pipetransformer.plan.runplan", "pipetransformer.plan.command", "pipetransformer.dp.batch",
                "pipetransformer.freeze.policies"]
IMPORT_TIMEOUT_S = 60


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_imports_without_torch(module: str) -> None:
    code = f"import {module}, sys; assert 'torch' not in sys.modules, 'importing {module} imported torch'"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            timeout=IMPORT_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-2000:]


def test_torch_names_of_the_pipe_package_still_load_on_use() -> None:
    """``from pipetransformer.pipe import profile_blocks`` (the examples' spelling) works, lazily."""
    from pipetransformer.pipe import broadcast_costs, profile_blocks
    from pipetransformer.pipe.profile import broadcast_costs as direct_broadcast
    from pipetransformer.pipe.profile import profile_blocks as direct_profile

    assert (profile_blocks, broadcast_costs) == (direct_profile, direct_broadcast)
