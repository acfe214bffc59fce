"""How worker failures are injected (tests) and reported (the launcher's last line)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from pipetransformer.cli import _describe_failures
from pipetransformer.faults import FAULT_ENV, maybe_fail


def _failure(local_rank: int, exitcode: int) -> ProcessFailure:
    return ProcessFailure(local_rank=local_rank, pid=1000 + local_rank, exitcode=exitcode, error_file="<N/A>")


def test_the_worker_that_died_is_named_not_the_ones_the_launcher_stopped() -> None:
    error = ChildFailedError("train", {0: _failure(0, -signal.SIGTERM), 1: _failure(1, -signal.SIGKILL)})
    assert _describe_failures(error) == "training failed: worker rank 1 killed by SIGKILL"


def test_exit_codes_and_an_external_sigterm_of_everyone_are_reported() -> None:
    assert _describe_failures(ChildFailedError("train", {3: _failure(1, 2)})) == \
        "training failed: worker rank 3 exited with code 2"
    everyone = ChildFailedError("train", {0: _failure(0, -signal.SIGTERM), 1: _failure(1, -signal.SIGTERM)})
    assert _describe_failures(everyone) == "training failed: worker rank 0 killed by SIGTERM, rank 1 killed by SIGTERM"
    assert _describe_failures(RuntimeError("boom")) == "training failed (RuntimeError)"


def _exit_code_with_fault(spec: str, rank: int, restart_count: str = "0") -> int:
    code = f"from pipetransformer.faults import maybe_fail; maybe_fail('handover', {rank})"
    env = {FAULT_ENV: spec, "TORCHELASTIC_RESTART_COUNT": restart_count}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True).returncode


def test_a_fault_kills_only_the_named_rank_in_the_first_attempt() -> None:
    assert _exit_code_with_fault("handover:1", rank=1) == -signal.SIGKILL
    assert _exit_code_with_fault("handover:1", rank=0) == 0
    assert _exit_code_with_fault("handover:1", rank=1, restart_count="1") == 0


def test_a_malformed_fault_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "handoff:1")
    with pytest.raises(ValueError, match="expected <point>:<rank>"):
        maybe_fail("handover", 0)
    monkeypatch.delenv(FAULT_ENV)
    maybe_fail("handover", 0)  # unset: nothing happens
