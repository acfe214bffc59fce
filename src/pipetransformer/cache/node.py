"""One activation store per node, shared by its local ranks: the trainer's AutoCache and the plain API's cache open
it the same way."""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist

from pipetransformer.cache.store import ActivationStore, StoreLayout
from pipetransformer.config import BYTES_PER_GB, CacheConfig
from pipetransformer.distributed import DistEnv, broadcast_from_local_leader
from pipetransformer.models.blocks import ActivationSpec

__all__ = ["open_node_store"]


def open_node_store(env: DistEnv, num_samples: int, spec: ActivationSpec, settings: CacheConfig,
                    device: torch.device | None = None) -> ActivationStore:
    """Each node's local leader creates the store (shared memory up to ``settings.memory_gb``, the rest on node-local
    disk), the others attach with its layout, and once all have mapped it its names are unlinked, so nothing is left
    behind even after ``kill -9`` (every rank must call; ``device``: where the group can send the layout)."""
    disk_dir = settings.dir or tempfile.gettempdir()  # node-local: a run directory may be shared
    store: ActivationStore | None = None
    layout_json = ""
    if env.is_local_leader:
        store = ActivationStore.create(num_samples, spec, int(settings.memory_gb * BYTES_PER_GB), disk_dir=disk_dir)
        layout_json = store.layout.to_json()
    layout_json = broadcast_from_local_leader(env, layout_json, device=device)  # every node has its own store
    if store is None:
        store = ActivationStore.attach(StoreLayout.from_json(layout_json))
    if env.distributed:
        dist.barrier()
    if env.is_local_leader:
        store.unlink_names()
    return store
