"""``examples/train_from_python.py`` runs as a user runs it, so the README's Python API stays true (the regression
example has its own test, ``test_regression.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_from_python.py"
TIMEOUT_S = 300


def test_the_python_api_example_trains_and_uses_the_pieces_alone() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([sys.executable, str(EXAMPLE)], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert any(line.startswith("trained 4 steps") for line in lines), result.stdout
    assert "geometric policy freezes layers [0, 1]" in lines, result.stdout
    assert any(line.startswith("stages (block ranges): [(0,") for line in lines), result.stdout
