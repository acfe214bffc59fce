"""Worker processes on one machine joined by a real process group: what the tests that spawn their own
workers (rather than launching the CLI) share."""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta

import torch
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
    process ends without tearing gloo down. A worker's groups and tensors live in its test function's frames and
    objects up to here, so a normal exit would meet their gloo threads in the interpreter's finalization: "terminate
    called without an active exception", SIGABRT, now and then (test_handover, 2026-11-24 and -26; the cause and the
    trainer's ordered teardown: ``pipetransformer.distributed.shutdown_distributed``, tests/integration/test_teardown.py).
    What a test checks is written to its files before this call."""
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def record_buckets(state: list[int], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook: an all-reduce (averaged, as DDP's own) that records how many gradient entries it carried in
    ``state`` (register it with ``ddp.register_comm_hook(state, record_buckets)``)."""
    state.append(bucket.buffer().numel())
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


# DDP checks a hook's annotations as objects; ``from __future__ import annotations`` made them strings.
record_buckets.__annotations__.update(bucket=dist.GradBucket, state=list[int],
                                      **{"return": torch.futures.Future[torch.Tensor]})
