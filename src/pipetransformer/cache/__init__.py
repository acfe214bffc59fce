"""AutoCache: reuse the frozen prefix's output per sample instead of recomputing it every epoch."""

from __future__ import annotations

from pipetransformer.cache.prefix import CacheMetrics, FrozenPrefixCache
from pipetransformer.cache.store import (
    FILE_PREFIX,
    ActivationStore,
    StoreLayout,
    StoreRead,
    StoreStats,
    spec_from_activation,
)

__all__ = [
    "FILE_PREFIX",
    "ActivationStore",
    "CacheMetrics",
    "FrozenPrefixCache",
    "StoreLayout",
    "StoreRead",
    "StoreStats",
    "spec_from_activation",
]
