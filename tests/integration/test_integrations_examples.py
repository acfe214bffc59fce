"""The integrations' examples run as a user runs them (at a tiny size), so docs/integrations.md stays true."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300
TINY = ["--steps", "12", "--rows", "64", "--prior", "2"]  # 12 steps are too few for any evidence


# --prior 2 freezes MiniLM's embeddings and 2 of its 6 layers before the first step (the default freezes nothing)
PRIOR_REPORTED = {"autofreeze_plain_loop.py": "step 0: the first 2 layers frozen (the embeddings and the bottom 2",
                  "autofreeze_accelerate.py": "step 0: the first 2 layers frozen (the embeddings and the bottom 2",
                  "autofreeze_trainer.py": "decisions: [2]"}
# the Trainer's 64 rows in batches of 8: 8 steps record them all, the 4 steps of the second epoch are served;
# Accelerate's 12 steps of 2 micro-batches of 8 read the 64 rows three times: recorded once, then served twice
CACHE_REPORTED = {"autofreeze_trainer.py": "cache: 32 served, 64 computed",
                  "autofreeze_accelerate.py": "cache: 128 served, 64 computed"}


@pytest.mark.parametrize("example", sorted(PRIOR_REPORTED))
def test_the_example_runs_and_reports_the_freeze_outcome(example: str, tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([sys.executable, str(ROOT / "examples" / example), *TINY], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-4000:]
    # 12 steps are too few for the default descent test (3 windows of at least 10 steps): the outcome says so
    assert "nothing froze" in result.stdout and "decision windows" in result.stdout, result.stdout
    assert PRIOR_REPORTED[example] in result.stdout, result.stdout
    assert CACHE_REPORTED.get(example, "") in result.stdout, result.stdout
