"""Checkpoints, exact resume and fault tolerance on real gloo workers.

A worker is SIGKILLed from outside mid-epoch; torchrun restarts the job, which resumes from its newest
checkpoint and must end bit-identical to a run that was never interrupted, having trained on every
sample of every epoch exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from jobs import (JOB_TIMEOUT_S, assert_close_states, event_scalars, logged_records, optimizer_state, run_job,
                  seen_samples, signal_worker_after, start_job, summary, wait_for_steps, weights)
from pipetransformer.faults import FAULT_ENV

pytestmark = pytest.mark.slow

VIT = "tiny_vit.yaml"
SAMPLES = 96
COMMON = ("run.save_model=true", "run.record_samples=true", "deterministic=true", f"data.max_train_samples={SAMPLES}",
          "train.epochs=6", "checkpoint.every_steps=3", "freeze.enabled=true", "freeze.policy=schedule",
          "freeze.interval_unit=steps", "freeze.schedule=[[0,1],[9,2]]")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run every SIGKILL case must end identical to (run once: the cases differ only in whom they kill)."""
    reference = tmp_path_factory.mktemp("sigkill") / "uninterrupted"
    run_job(VIT, reference, *COMMON, nproc=2)
    return reference


@pytest.mark.parametrize("rank", [1, 0], ids=["worker", "rank0-the-writer"])
def test_sigkill_of_a_worker_resumes_exactly(tmp_path: Path, uninterrupted: Path, rank: int) -> None:
    """Rank 0 writes checkpoints and metrics; killing it checks that nothing it wrote is lost or half there."""
    reference = uninterrupted
    crashed = tmp_path / "crashed"
    job = start_job(VIT, crashed, *COMMON, nproc=2, extra_args=("--max-restarts", "1"))
    # Past the checkpoint at step 6, mid-epoch 1.
    killed = signal_worker_after(job, crashed, rank=rank, steps=7, signum=signal.SIGKILL)
    output, _ = job.communicate(timeout=JOB_TIMEOUT_S)
    assert killed, f"the job ended before a worker could be killed:\n{output[-3000:]}"
    assert job.returncode == 0, output[-5000:]

    result = summary(crashed)
    assert result["restarts"] == 1
    assert result["steps"] == summary(reference)["steps"] == 36
    # The schedule's entry at 0 froze layer 0 before the first step: recorded once, not again by the resume.
    assert [d["step"] for d in result["freeze_decisions"]] == [d["step"] for d in summary(reference)[
        "freeze_decisions"]] == [0, 9]
    assert [e["step"] for e in logged_records(crashed, "freeze")] == [0, 9]
    for name, tensor in weights(reference).items():
        assert torch.equal(weights(crashed)[name], tensor), f"{name} differs after resume"
    for name, tensor in optimizer_state(reference).items():
        assert torch.equal(optimizer_state(crashed)[name], tensor), f"{name} differs after resume"
    for epoch, indices in seen_samples(crashed).items():
        assert sorted(indices) == list(range(SAMPLES)), f"epoch {epoch}: not every sample exactly once"
    assert len(seen_samples(crashed)) == 6
    # The logs hold each step once: what the killed attempt wrote after its checkpoint was cut at the resume.
    assert [s["step"] for s in logged_records(crashed, "step")] == list(range(1, 37))
    for log in crashed.glob("samples-rank*.jsonl"):
        assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == list(range(1, 37)), log.name
    # TensorBoard shows each step once, the killed attempt's steps up to its checkpoint and the resumed run's after.
    expected = [(s["step"], pytest.approx(s["loss"])) for s in logged_records(reference, "step")]
    assert event_scalars(crashed / "tensorboard", "train/loss") == expected


EXIT_INTERRUPTED = 130


def test_ctrl_c_checkpoints_exits_130_and_resume_ends_equal(tmp_path: Path, uninterrupted: Path) -> None:
    """Ctrl-C in a terminal: SIGINT to the launcher and both workers (one process group). The run checkpoints at the
    step it stops at (mid-epoch 1), exits 130 with one line that names the command to continue, and that command
    ends bit-identical to a run that was never interrupted."""
    interrupted = tmp_path / "interrupted"
    job = start_job(VIT, interrupted, *COMMON, nproc=2, new_session=True)
    assert wait_for_steps(job, interrupted, steps=7), "the job ended before Ctrl-C"
    os.killpg(job.pid, signal.SIGINT)
    output, _ = job.communicate(timeout=JOB_TIMEOUT_S)
    assert job.returncode == EXIT_INTERRUPTED, output[-3000:]
    stop = summary(interrupted)["interrupted"]
    assert stop["signal"] == "SIGINT" and 7 <= stop["step"] < 36 and stop["step"] % 6, stop  # mid-epoch
    assert Path(stop["checkpoint"]).name == f"step-{stop['step']:09d}"
    last = output.strip().splitlines()[-1]
    assert last.startswith(f"interrupted at step {stop['step']}; continue with: pipetransformer train "), last
    assert last.endswith(f"--set run.dir={interrupted} --resume") and "Traceback" not in output, output[-3000:]

    run_job(VIT, interrupted, *COMMON, nproc=2, extra_args=("--resume",))
    assert "interrupted" not in summary(interrupted) and summary(interrupted)["steps"] == 36
    for name, tensor in weights(uninterrupted).items():
        assert torch.equal(weights(interrupted)[name], tensor), f"{name} differs after resume"
    for name, tensor in optimizer_state(uninterrupted).items():
        assert torch.equal(optimizer_state(interrupted)[name], tensor), f"{name} differs after resume"


@pytest.mark.parametrize("nproc", [1, 2], ids=["one-process", "kill-INT-to-the-launcher-alone"])
def test_sigint_to_the_command_checkpoints_and_exits_130(tmp_path: Path, nproc: int) -> None:
    """SIGINT to the command's process only: a lone trainer stops itself; a launcher forwards it to its workers."""
    job = start_job(VIT, tmp_path, "train.epochs=20", "data.max_train_samples=64", nproc=nproc)
    assert wait_for_steps(job, tmp_path, steps=3), "the job ended before SIGINT"
    os.kill(job.pid, signal.SIGINT)
    output, _ = job.communicate(timeout=JOB_TIMEOUT_S)
    assert job.returncode == EXIT_INTERRUPTED, output[-3000:]
    step = summary(tmp_path)["interrupted"]["step"]
    assert (tmp_path / "checkpoints" / f"step-{step:09d}").is_dir()
    assert output.strip().splitlines()[-1].startswith(f"interrupted at step {step}; continue with: ")


def test_sigterm_then_resume_on_fewer_workers_after_corrupt_newest_checkpoint(tmp_path: Path) -> None:
    """SIGTERM stops a 2-worker job with a checkpoint; corrupt that one; resume on 1 worker from the one before.
    The job logs every fifth step (``run.log_every=5``), so it reads the device only there and at its checkpoints
    (every third): the stop waits for the next read, and the weights are those of the reference, which read every
    step."""
    reference = tmp_path / "reference"
    run_job(VIT, reference, *COMMON, nproc=1)
    job_dir = tmp_path / "job"
    job = start_job(VIT, job_dir, *COMMON, "run.log_every=5", nproc=2)
    assert signal_worker_after(job, job_dir, rank=1, steps=4, signum=signal.SIGTERM), "the job ended too early"
    output, _ = job.communicate(timeout=JOB_TIMEOUT_S)
    assert job.returncode == 0, output[-3000:]
    stopped_at = summary(job_dir)["steps"]
    assert 15 <= stopped_at < 36 and (stopped_at % 3 == 0 or stopped_at % 5 == 0), stopped_at
    checkpoints = sorted((job_dir / "checkpoints").glob("step-*"))
    assert checkpoints[-1].name == f"step-{stopped_at:09d}", "no checkpoint at the SIGTERM step"
    newest = checkpoints[-1] / "weights.safetensors"
    newest.write_bytes(newest.read_bytes()[:-100])  # truncated
    job = job_dir
    result = run_job(VIT, job, *COMMON, nproc=1, extra_args=("--resume",))
    assert checkpoints[-1].name in result.stderr and "corrupt" in result.stderr.lower()
    assert summary(job)["restarts"] == 1 and summary(job)["steps"] == 36
    assert_close_states(weights(job), weights(reference), 2e-4, 1e-7)
    assert_close_states(optimizer_state(job), optimizer_state(reference), 2e-4, 1e-7)


def test_non_finite_loss_stops_with_step_and_keeps_last_checkpoint(tmp_path: Path) -> None:
    result = run_job(VIT, tmp_path, "train.lr=1.0e+12", "train.grad_clip=null", "checkpoint.every_steps=1",
                     "train.warmup_fraction=0.0", expect_ok=False)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: non-finite loss") and "at step" in last, last
    assert "Traceback" not in result.stderr
    assert any((tmp_path / "checkpoints").glob("step-*")), "the last good checkpoint is gone"


ELASTIC = ("run.save_model=true", "run.record_samples=true", "data.max_train_samples=96", "freeze.enabled=true",
           "freeze.policy=schedule", "freeze.interval_unit=steps", "freeze.schedule=[[3,2]]", "pipe.enabled=true",
           "dp.enabled=true", "pipe.device_memory_gb=0.008", "checkpoint.every_steps=2", "dist.timeout_s=120")
HANDOVER_FAULT = {FAULT_ENV: "handover:1"}


def test_worker_dying_in_a_handover_fails_fast_then_restart_resumes_exactly(tmp_path: Path) -> None:
    """Rank 1 dies as the 2x1 -> 1x2 handover at step 3 starts; rank 0 waits for its blocks.

    Without restarts: a non-zero exit long before the collective timeout, saying which worker died. With
    one restart: resumed from the step-2 checkpoint, the handover redone, bit-identical to no fault.
    """
    reference = tmp_path / "reference"
    run_job(VIT, reference, *ELASTIC, nproc=2)
    assert [h["step"] for h in summary(reference)["layout_history"]] == [0, 3]

    failed = tmp_path / "failed"
    started = time.monotonic()
    result = run_job(VIT, failed, *ELASTIC, nproc=2, expect_ok=False, env=HANDOVER_FAULT)
    assert result.returncode != 0 and time.monotonic() - started < 120, "waited for the collective timeout"
    last = result.stderr.strip().splitlines()[-1]
    # Rank 0 may see the dead peer's connection reset and exit with an error before torchrun stops it: then it is
    # named too, so the message must name rank 1's death, not be only that.
    named_the_death = last.startswith("error: training failed: worker ") and "rank 1 killed by SIGKILL" in last
    assert named_the_death, result.stderr[-3000:]

    restarted = tmp_path / "restarted"
    run_job(VIT, restarted, *ELASTIC, nproc=2, extra_args=("--max-restarts", "1"), env=HANDOVER_FAULT)
    assert summary(restarted)["restarts"] == 1
    layouts = [(h["step"], h["stages"], h["dp_width"]) for h in summary(restarted)["layout_history"]]
    assert layouts == [(0, 2, 1), (2, 2, 1), (3, 1, 2)], "expected: start, resume at step 2, handover at step 3"
    for name, tensor in weights(reference).items():
        assert torch.equal(weights(restarted)[name], tensor), f"{name} differs after the restart"
    for name, tensor in optimizer_state(reference).items():
        assert torch.equal(optimizer_state(restarted)[name], tensor), f"{name} differs after the restart"
    for epoch, indices in seen_samples(restarted).items():
        assert sorted(indices) == list(range(96)), f"epoch {epoch}: not every sample exactly once"


TEXT = "tiny_text.yaml"
EPOCH_FREEZE = ("run.save_model=true", "run.record_samples=true", "deterministic=true", "freeze.enabled=true",
                "freeze.policy=geometric", "freeze.interval=1", "freeze.interval_unit=epochs", "freeze.alpha=0.5",
                "freeze.max_fraction=1.0")


def test_max_steps_mid_epoch_then_resume_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    """tiny_text: 2 epochs of 8 steps. Stopped by train.max_steps=5 mid-epoch, then resumed without a limit: the
    rest of epoch 0 is trained, the epoch-end freeze happens at step 8 (not at the stop), and the end is
    bit-identical to a run that never stopped."""
    reference = tmp_path / "reference"
    run_job(TEXT, reference, *EPOCH_FREEZE)
    stopped = tmp_path / "stopped"
    run_job(TEXT, stopped, *EPOCH_FREEZE, "train.max_steps=5")
    assert summary(stopped)["freeze_decisions"] == []
    run_job(TEXT, stopped, *EPOCH_FREEZE, extra_args=("--resume",))

    result, expected = summary(stopped), summary(reference)
    assert (result["steps"], result["train_samples"]) == (expected["steps"], expected["train_samples"]) == (16, 512)
    decided_at = [d["step"] for d in result["freeze_decisions"]]
    assert decided_at == [d["step"] for d in expected["freeze_decisions"]] == [8, 16]
    for name, tensor in weights(reference).items():
        assert torch.equal(weights(stopped)[name], tensor), f"{name} differs after resume"
    assert optimizer_state(stopped).keys() == optimizer_state(reference).keys()
    for name, tensor in optimizer_state(reference).items():
        assert torch.equal(optimizer_state(stopped)[name], tensor), f"{name} differs after resume"
    assert seen_samples(stopped) == seen_samples(reference)


def test_a_failed_checkpoint_write_stops_every_worker_with_its_message(tmp_path: Path) -> None:
    """Rank 0 cannot write its checkpoint: every worker stops with that one-line error, none with a lost peer."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = run_job(VIT, tmp_path / "run", f"checkpoint.dir={blocker}/checkpoints", "checkpoint.every_steps=1",
                     nproc=2, expect_ok=False)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: cannot write checkpoint to {blocker}")
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
