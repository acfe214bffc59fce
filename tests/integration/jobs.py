"""Run real training jobs (real processes, real gloo) through the CLI and read what they leave behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 600
POLL_S = 0.02


def _train_command(config: str, run_dir: Path, overrides: tuple[str, ...], nproc: int,
                   extra_args: tuple[str, ...]) -> list[str]:
    command = [sys.executable, "-m", "pipetransformer.cli", "train", str(ROOT / "configs" / config),
               "--nproc-per-node", str(nproc), "--set", f"run.dir={run_dir}", *extra_args]
    for item in overrides:
        command += ["--set", item]
    return command


def run_job(config: str, run_dir: Path, *overrides: str, nproc: int = 1, expect_ok: bool = True,
            extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``pipetransformer train`` as a user runs it; ``run_dir`` gets summary, metrics, model."""
    result = subprocess.run(_train_command(config, run_dir, overrides, nproc, extra_args), cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})},
                            capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    if expect_ok and result.returncode != 0:
        raise AssertionError(f"job failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return result


def start_job(config: str, run_dir: Path, *overrides: str, nproc: int = 1, extra_args: tuple[str, ...] = (),
              new_session: bool = False) -> subprocess.Popen[str]:
    """Like :func:`run_job`, in the background (for tests that signal or kill its workers). ``new_session``: the job
    leads a process group of its own, as a terminal's foreground job does (Ctrl-C signals the whole group)."""
    return subprocess.Popen(_train_command(config, run_dir, overrides, nproc, extra_args), cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=new_session)


def wait_for_steps(job: subprocess.Popen[str], run_dir: Path, steps: int) -> bool:
    """Wait until ``steps`` steps are logged; False if the job ended first."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline and job.poll() is None:
        if logged_steps(run_dir) >= steps:
            return True
        time.sleep(POLL_S)
    return False


def logged_steps(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return 0
    return sum('"event": "step"' in line for line in metrics.read_text().splitlines())


def worker_pid(run_dir: Path, rank: int) -> int | None:
    """The worker process of ``rank`` in the job writing to ``run_dir`` (found through /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(run_dir) in cmdline and f"RANK={rank}".encode() in environ and f"LOCAL_RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def signal_worker_after(job: subprocess.Popen[str], run_dir: Path, rank: int, steps: int, signum: int) -> bool:
    """Send ``signum`` to a worker once ``steps`` steps are logged; False if the job ended first."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline and job.poll() is None:
        if logged_steps(run_dir) >= steps:
            pid = worker_pid(run_dir, rank)
            if pid is not None:
                os.kill(pid, signum)
                return True
        time.sleep(POLL_S)
    return False


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "model.safetensors"))


def optimizer_state(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "optimizer.safetensors"))


def event_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    """``(step, value)`` of one TensorBoard tag as TensorBoard itself shows it: every event file in
    ``log_dir``, events a later writer purged left out."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every event, not a sample
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


def logged_records(run_dir: Path, event: str) -> list[dict[str, Any]]:
    """The records of one event kind in ``metrics.jsonl``, in the order they were written."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["event"] == event]


def seen_samples(run_dir: Path) -> dict[int, list[int]]:
    """Per epoch, every sample index the replicas trained on in the steps that counted.

    A step redone after a restart from a checkpoint replaces its earlier attempt (the later line wins).
    """
    steps: dict[tuple[int, int, str], list[int]] = {}
    for path in sorted(run_dir.glob("samples-rank*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            steps[(record["epoch"], record["step"], path.name)] = record["indices"]
    seen: dict[int, list[int]] = {}
    for (epoch, _, _), indices in sorted(steps.items()):
        seen.setdefault(epoch, []).extend(indices)
    return seen


def without_key_biases(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with attention key biases (and their optimizer state) zeroed.

    Their gradients are analytically zero (softmax ignores a per-query constant), so what they get is
    float noise of the reduction order, which Adam normalises into steps up to the learning rate.
    Two runs that differ only in how many processes summed the gradients agree on everything else;
    on these entries they cannot.
    """
    masked = dict(state)
    for name, tensor in state.items():
        if ".qkv.bias" in name and tensor.dim() == 1:  # built-in ViT: fused [query | key | value] projection
            width = tensor.shape[0] // 3
            masked[name] = tensor.clone()
            masked[name][width:2 * width] = 0
        elif ".key.bias" in name:  # Hugging Face encoders
            masked[name] = torch.zeros_like(tensor)
    return masked


def assert_close_states(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float,
                        atol: float) -> None:
    """Every tensor but the attention key biases equal within ``rtol`` of the largest value of its kind.

    Relative to the largest value of its kind (weights, each optimizer state), not per tensor: a tensor
    of near-zero values can differ by float noise that is large relative to itself.
    """
    assert actual.keys() == expected.keys(), sorted(set(actual) ^ set(expected))[:10]
    actual, expected = without_key_biases(actual), without_key_biases(expected)

    def kind(name: str) -> str:
        suffix = name.rsplit(".", 1)[-1]
        return suffix if suffix in ("step", "exp_avg", "exp_avg_sq", "momentum_buffer") else "weight"

    scales: dict[str, float] = {}
    for name, tensor in expected.items():
        scales[kind(name)] = max(scales.get(kind(name), 0.0), tensor.double().abs().max().item())
    for name in expected:
        diff = (actual[name].double() - expected[name].double()).abs().max().item()
        bound = rtol * scales[kind(name)] + atol
        assert diff <= bound, f"{name}: max |diff| {diff:.3g} > {bound:.3g} ({kind(name)} scale {scales[kind(name)]:.3g})"
