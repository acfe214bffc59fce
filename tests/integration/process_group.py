"""Worker processes on one machine joined by a real process group: what the tests that spawn their own
workers (rather than launching the CLI) share."""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta

import torch.distributed as dist

LOOPBACK = "127.0.0.1"
TIMEOUT_S = 60  # a collective or send that finds no peer fails the test instead of hanging it


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


def join(rank: int, world_size: int, port: int, backend: str = "gloo") -> None:
    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=TIMEOUT_S))


def leave() -> None:
    """The worker's last call: a barrier (every peer is done with its collectives and point-to-point work), then the
    process ends without tearing gloo down. The teardown (``destroy_process_group``, or the interpreter's exit)
    aborted a worker now and then right after point-to-point transfers, barrier or not: "terminate called without an
    active exception", SIGABRT, once in about four full-suite runs (test_handover, 2026-11-24 and -26). What a test
    checks is written to its files before this call."""
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
