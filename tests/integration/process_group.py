"""Worker processes on one machine joined by a real process group: what the tests that spawn their own
workers (rather than launching the CLI) share."""

from __future__ import annotations

import os
import socket
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
    dist.barrier()  # no rank tears gloo down while a peer's point-to-point work is in flight
    dist.destroy_process_group()
