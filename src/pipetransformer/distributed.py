"""Process-group setup from torchrun's environment; the device and backend are settings, not code paths."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .config import DistConfig

__all__ = ["DistEnv", "init_distributed", "shutdown_distributed", "broadcast_string", "new_groups"]


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_leader(self) -> bool:
        return self.local_rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _resolve_device(config: DistConfig, local_rank: int) -> torch.device:
    wants_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if wants_cuda:
        if not torch.cuda.is_available():
            raise RuntimeError("dist.device=cuda but no CUDA device is visible: set dist.device: cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(config: DistConfig) -> DistEnv:
    """Join the torchrun job if there is one (RANK/WORLD_SIZE set), else run as a single process.

    The default group carries both a gloo backend (control messages and state handover on CPU tensors)
    and, on CUDA, NCCL for device tensors: one group, two transports, chosen per tensor by torch.
    """
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device = _resolve_device(config, local_rank)
    threads = config.threads_per_worker or max(1, (os.cpu_count() or 1) // local_world_size)
    torch.set_num_threads(threads)
    if device.type == "cuda":
        backend = "cpu:gloo,cuda:nccl" if config.backend in ("auto", "nccl") else "gloo"
    else:
        if config.backend == "nccl":
            raise RuntimeError("dist.backend=nccl needs CUDA devices: set dist.backend: gloo (or auto) on CPU")
        backend = "gloo"
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=config.timeout_s))
    return DistEnv(rank, world_size, local_rank, local_world_size, device, backend)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast_string(value: str, src: int = 0) -> str:
    """Broadcast a short string as bytes in a tensor (no pickling)."""
    if not dist.is_initialized():
        return value
    data = torch.tensor(list(value.encode()), dtype=torch.uint8)
    length = torch.tensor([data.numel()], dtype=torch.int64)
    dist.broadcast(length, src=src)
    if dist.get_rank() != src:
        data = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.broadcast(data, src=src)
    return bytes(data.tolist()).decode()


def new_groups(rank_lists: list[list[int]], rank: int) -> dist.ProcessGroup | None:
    """Create a group for every list (every rank must call this with the same lists, in the same order);
    return the one containing ``rank``. Single-rank groups are not created: nothing to communicate.
    """
    mine: dist.ProcessGroup | None = None
    for ranks in rank_lists:
        if len(ranks) < 2:
            continue
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine
