"""The GPU check (benchmarks/gpu) cannot rot between the rare days a GPU is lent: its dry run imports what every
step uses and builds and validates every config the steps train, on CPU, and its plan fits the time budget."""

from __future__ import annotations

import subprocess
import sys

from benchmark_scripts import BENCHMARKS, load_benchmark

DRY_RUN_TIMEOUT_S = 120


def test_the_dry_run_lists_every_step_and_validates_its_configs() -> None:
    gpu = load_benchmark("gpu")
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu" / "main.py"), "--dry-run"], capture_output=True,
                          text=True, timeout=DRY_RUN_TIMEOUT_S, cwd=BENCHMARKS.parent)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    listed = [line.split()[0] for line in done.stdout.splitlines() if line and not line.startswith("total")]
    assert listed == [step.name for step in gpu.STEPS]
    assert sum(step.budget_s for step in gpu.STEPS) <= gpu.TOTAL_BUDGET_S
    assert "config(s) valid" in done.stdout and "left out:" in done.stdout


def test_an_unknown_step_is_refused_before_anything_runs() -> None:
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu" / "main.py"), "--dry-run", "--only", "nope"],
                          capture_output=True, text=True, timeout=DRY_RUN_TIMEOUT_S, cwd=BENCHMARKS.parent)
    assert done.returncode == 2 and "unknown step 'nope'" in done.stderr


def test_the_optional_overhead_step_runs_by_name_only() -> None:
    gpu = load_benchmark("gpu")
    assert "overhead_vit" not in [step.name for step in gpu.STEPS], "the default steps fill the budget"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu" / "main.py"), "--dry-run", "--only", "overhead_vit"],
                          capture_output=True, text=True, timeout=DRY_RUN_TIMEOUT_S, cwd=BENCHMARKS.parent)
    assert done.returncode == 0 and done.stdout.startswith("overhead_vit"), done.stdout + done.stderr
