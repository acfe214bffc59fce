"""The GPU check (benchmarks/gpu) cannot rot between the rare days a GPU is lent: its dry run imports what every
step uses and builds and validates every config the steps train, on CPU, and its plan fits the time budget."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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


def test_the_optional_steps_run_by_name_only_and_fit_one_call() -> None:
    """``overhead_vit`` and ``freeze_vit`` are out of the default run and fit the budget together, and the freezing
    run's two configs build."""
    gpu = load_benchmark("gpu")
    optional = ["overhead_vit", "freeze_vit"]
    assert not set(optional) & {step.name for step in gpu.STEPS}, "the default steps fill the budget"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu" / "main.py"), "--dry-run", "--only",
                           ",".join(optional)],
                          capture_output=True, text=True, timeout=DRY_RUN_TIMEOUT_S, cwd=BENCHMARKS.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [line.split()[0] for line in done.stdout.splitlines()[:2]] == optional, done.stdout
    assert "freeze_vit" in done.stdout and "[2 config(s) valid]" in done.stdout, done.stdout


def test_the_freezing_run_freezes_half_the_layers_by_schedule_and_plain_never(tmp_path: Path) -> None:
    gpu = load_benchmark("gpu")
    plain, frozen = gpu.configs_of("freeze_vit", tmp_path)
    assert not plain.freeze.enabled and not plain.cache.enabled
    assert frozen.freeze.policy == "schedule" and frozen.cache.enabled
    assert frozen.freeze.schedule == [[gpu.FREEZE_AT_STEP, gpu.FREEZE_LAYERS]]
    assert 2 * gpu.FREEZE_LAYERS == frozen.model.vit["depth"], "half of ViT-B/16's layers"
    steps = plain.data.max_train_samples // plain.train.batch_size
    assert steps == gpu.FREEZE_STEPS_PER_EPOCH and gpu.FREEZE_AT_STEP < steps, "the freeze comes in the first epoch"
    assert plain.dist.device == frozen.dist.device == "cuda"


def test_the_documented_selections_name_real_steps_and_fit_the_budget() -> None:
    """docs/gpu-check.md's ``--only`` commands (the optional pair; issue 73's measurements in one call) name steps
    that exist and fit one call's budget: a loan is minutes, and a refused plan wastes them."""
    gpu = load_benchmark("gpu")
    budgets = {step.name: step.budget_s for step in (*gpu.STEPS, *gpu.OPTIONAL_STEPS)}
    doc = (BENCHMARKS.parent / "docs" / "gpu-check.md").read_text()
    selections = re.findall(r"gpu_check\.sh OUT_DIR --only ([\w,.-]+)`", doc)
    assert len(selections) >= 2, selections
    for selection in selections:
        names = selection.split(",")
        assert set(names) <= set(budgets), set(names) - set(budgets)
        assert sum(budgets[name] for name in names) <= gpu.TOTAL_BUDGET_S, selection
