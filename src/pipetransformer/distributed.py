"""Process-group setup from torchrun's environment; the device and backend are settings, not code paths."""

from __future__ import annotations

import gc
import json
import logging
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pipetransformer.config import ConfigError, DistConfig

logger = logging.getLogger(__name__)

_created_groups: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()
"""Every group :func:`new_groups` made, weakly: what :func:`shutdown_distributed` checks was released."""

__all__ = ["DistEnv", "check_device_settings", "init_distributed", "shutdown_distributed", "broadcast_string",
           "broadcast_tensors", "broadcast_from_local_leader", "gather_floats", "new_groups", "raise_together",
           "resolve_device", "threads_of_one_worker", "to_device", "wants_cuda", "worker_threads"]


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


def wants_cuda(config: DistConfig) -> bool:
    """Whether workers will run on CUDA devices (``dist.device``: cuda, or auto with one visible)."""
    return config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())


def check_device_settings(config: DistConfig) -> None:
    """Raise :class:`ConfigError` for a device or backend this machine cannot give."""
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("dist.device=cuda but no CUDA device is visible: set dist.device to cpu or auto")
    if config.backend == "nccl" and not wants_cuda(config):
        raise ConfigError("dist.backend=nccl needs CUDA devices: set dist.backend to gloo or auto on CPU")


def resolve_device(config: DistConfig, local_rank: int = 0) -> torch.device:
    """The device ``dist.device`` gives the ``local_rank``-th worker of a node (made current on CUDA), after
    :func:`check_device_settings`."""
    check_device_settings(config)
    if wants_cuda(config):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (a batch) on ``device`` without waiting: a CUDA copy from pageable memory makes the host wait for
    the stream, one from pinned memory does not (torch keeps the pinned block until the copy is done). On the CPU, the
    tensor itself."""
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def worker_threads(config: DistConfig, local_world_size: int) -> int:
    """Torch threads of one worker: ``dist.threads_per_worker``, else this machine's cores shared by its workers."""
    return config.threads_per_worker or max(1, (os.cpu_count() or 1) // local_world_size)


@contextmanager
def threads_of_one_worker(config: DistConfig, local_world_size: int) -> Iterator[None]:
    """Run torch with the threads one of ``local_world_size`` workers gets (:func:`worker_threads`), then restore:
    what this process measures is then what a worker of the run will see."""
    threads = torch.get_num_threads()
    torch.set_num_threads(worker_threads(config, local_world_size))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def init_distributed(config: DistConfig) -> DistEnv:
    """Join the torchrun job if there is one (RANK/WORLD_SIZE set), else run as a single process.

    The default group carries both a gloo backend (control messages and state handover on CPU tensors)
    and, on CUDA, NCCL for device tensors: one group, two transports, chosen per tensor by torch.
    """
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device = resolve_device(config, local_rank)
    torch.set_num_threads(worker_threads(config, local_world_size))
    if device.type == "cuda":
        backend = "cpu:gloo,cuda:nccl" if config.backend in ("auto", "nccl") else "gloo"
    else:
        backend = "gloo"
    if world_size > 1 and not dist.is_initialized():
        _import_modules_that_keep_the_default_group()
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=config.timeout_s))
    return DistEnv(rank, world_size, local_rank, local_world_size, device, backend)


def _import_modules_that_keep_the_default_group() -> None:
    """Import, before the default group exists, the torch modules that capture it when imported after.

    ``torch.distributed.nn.functional`` gives ten functions the default argument ``group=group.WORLD``,
    evaluated at import; torch imports it lazily (the first ``torch.optim`` optimizer imports ``torch._dynamo``,
    which imports it). Imported after ``init_process_group``, those defaults keep the default group alive past
    ``destroy_process_group``, with its gloo worker threads, until the interpreter's finalization: a worker
    thread that then drops the last reference to a Python-owned tensor of a finished collective must take the
    GIL, which a finalizing interpreter answers by ending the thread (``pthread_exit``), whose unwinding through
    gloo's ``noexcept`` run loop is ``std::terminate`` ("terminate called without an active exception",
    SIGABRT) after the run has finished. Imported first, the defaults hold None."""
    import torch.distributed.nn  # noqa: F401  (its import is the point)


def shutdown_distributed() -> int:
    """Destroy every process group and collect what held them, so their gloo worker threads are joined here
    rather than torn down during the interpreter's finalization (see
    :func:`_import_modules_that_keep_the_default_group`). No barrier and no wait on a peer: a rank whose peer
    died still ends. Returns how many groups something still holds (0 when the teardown is clean); those are
    logged, as each is a chance of an abort at exit."""
    if not dist.is_initialized():
        return 0
    groups = weakref.WeakSet(_created_groups)
    groups.add(dist.group.WORLD)
    dist.destroy_process_group()  # every group: subgroups already destroyed are gone from torch's registry
    gc.collect()  # cycles (autograd hooks, pipeline stages) that held a group
    if groups:
        logger.warning("%d process group(s) still referenced after destroy_process_group: their threads outlive "
                       "the run and may abort the process at exit", len(groups))
    return len(groups)


def broadcast_string(value: str, src: int = 0, device: torch.device | None = None) -> str:
    """Broadcast a short string as bytes in a tensor (no pickling), on ``device`` (default: the host; a group with
    NCCL alone needs the rank's CUDA device)."""
    if not dist.is_initialized():
        return value
    data = torch.tensor(list(value.encode()), dtype=torch.uint8, device=device)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src)
    if dist.get_rank() != src:
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src)
    return bytes(data.tolist()).decode()


def broadcast_from_local_leader(env: DistEnv, value: str, device: torch.device | None = None) -> str:
    """The string of this node's local leader (local rank 0), on every rank of the node: each node's leader
    broadcasts its own in turn, so what is per node (a shared-memory file's name) reaches that node's ranks
    (every rank must call; ``device`` as for :func:`broadcast_string`)."""
    if not env.distributed:
        return value
    node_leader = env.rank - env.local_rank
    values = [broadcast_string(value if env.rank == leader else "", src=leader, device=device)
              for leader in range(0, env.world_size, env.local_world_size)]
    return values[node_leader // env.local_world_size]


def raise_together(message: str, error: type[Exception]) -> None:
    """Every rank calls this with its error message ("" if it has none); if any rank has one, every rank raises
    ``error`` with the lowest such rank's message, else all return.

    A rank that fails alone (a checkpoint it cannot read or write) would leave the others in their next
    collective: with gloo they die on a lost peer with a traceback, with NCCL they wait for ``dist.timeout_s``.
    """
    if not dist.is_initialized():
        if message:
            raise error(message)
        return
    world = dist.get_world_size()
    failed = torch.tensor([dist.get_rank() if message else world], dtype=torch.int64)
    dist.all_reduce(failed, op=dist.ReduceOp.MIN)
    source = int(failed.item())
    if source < world:
        raise error(broadcast_string(message, src=source))


def gather_floats(values: Sequence[float]) -> list[list[float]]:
    """Every rank's ``values`` (as many on each), on every rank, in rank order."""
    mine = torch.tensor(list(values), dtype=torch.float64)
    if not dist.is_initialized():
        return [mine.tolist()]
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [g.tolist() for g in gathered]


def broadcast_tensors(tensors: Mapping[str, torch.Tensor] | None, src: int = 0) -> dict[str, torch.Tensor]:
    """``src``'s named CPU tensors on every rank (others pass None): names, shapes and dtypes go first as JSON,
    so nothing is pickled."""
    if not dist.is_initialized():
        return dict(tensors or {})
    header = ""
    if dist.get_rank() == src:
        assert tensors is not None
        header = json.dumps([[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in tensors.items()])
    received: dict[str, torch.Tensor] = {}
    for name, shape, dtype in json.loads(broadcast_string(header, src=src)):
        tensor = (tensors[name].detach().cpu().contiguous() if tensors is not None and dist.get_rank() == src
                  else torch.empty(shape, dtype=getattr(torch, dtype)))
        dist.broadcast(tensor, src=src)
        received[name] = tensor
    return received


def new_groups(rank_lists: list[list[int]], rank: int) -> dist.ProcessGroup | None:
    """Create a group for every list (every rank must call this with the same lists, in the same order);
    return the one containing ``rank``. Single-rank groups are not created: nothing to communicate.
    """
    mine: dist.ProcessGroup | None = None
    for ranks in rank_lists:
        if len(ranks) < 2:
            continue
        group = dist.new_group(ranks)
        if isinstance(group, dist.ProcessGroup):  # a rank outside ``ranks`` gets a non-member marker, not a group
            _created_groups.add(group)
        if rank in ranks:
            mine = group
    return mine
