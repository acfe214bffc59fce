"""The Python-API example runs as a user runs it and prints what its docstring promises."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_from_python.py"
TIMEOUT_S = 300


def test_python_api_example_trains_and_uses_the_pieces(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([sys.executable, str(EXAMPLE)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(":", 1) if ":" in line else (line, "") for line in result.stdout.splitlines())
    assert any(line.startswith("trained 4 steps, eval accuracy ") for line in lines)
    blocks = ast.literal_eval(lines["blocks"].strip())
    assert blocks == ["embeddings", "layer_0", "layer_1", "layer_2", "layer_3", "head"]
    assert "geometric policy freezes layers [0, 1]" in lines
    bounds = ast.literal_eval(lines["stages (block ranges)"].strip())
    assert len(bounds) == 2 and bounds[0][0] == 0 and bounds[-1][1] == len(blocks)
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert list(tmp_path.iterdir()) == []  # the run directory was a temporary one
