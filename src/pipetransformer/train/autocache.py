"""AutoCache in a run: the frozen prefix's output per sample, from a store every local worker shares.

The store opens the first time a layout caches blocks (all ranks at the same moment, as a transition
happens): each node's local leader creates it (shared memory, spilling to node-local disk), the others
attach, and once all have mapped it its names are unlinked, so nothing is left behind even after
``kill -9``. Training samples are keyed by their index, evaluation samples after them, so evaluations
too run the frozen layers once. Without cached blocks the frozen prefix runs without autograd.
"""

from __future__ import annotations

import torch

from pipetransformer.cache.prefix import CacheMetrics, FrozenPrefixCache
from pipetransformer.cache.node import open_node_store
from pipetransformer.cache.store import ActivationStore, spec_from_activation
from pipetransformer.config import CacheConfig
from pipetransformer.data.batch import Batch, IndexedDataset
from pipetransformer.data.text import TextDataset
from pipetransformer.distributed import DistEnv, to_device
from pipetransformer.models.blocks import Activation, BlockSequence
from pipetransformer.pipe.planner import LayoutPlan
from pipetransformer.train.build import example_inputs

__all__ = ["AutoCache"]


class AutoCache:
    """Serves the activation entering the first block any stage runs, for training and evaluation batches."""

    def __init__(self, model: BlockSequence, env: DistEnv, settings: CacheConfig, *, train_set: IndexedDataset,
                 eval_samples: int, max_length: int) -> None:
        self.model = model
        self.env = env
        self.settings = settings
        self.train_set = train_set
        self.train_samples = len(train_set)
        self.eval_samples = eval_samples
        self.max_length = max_length  # text: a record holds this many tokens
        self.store: ActivationStore | None = None
        self.training: FrozenPrefixCache | None = None
        self.evaluation: FrozenPrefixCache | None = None  # its own hit counters: training's hit rate stays training's

    def cached_blocks(self, frozen_prefix_layers: int) -> int:
        """Blocks served from the store for that many leading frozen layers (with the embeddings), or 0."""
        if not self.settings.enabled or frozen_prefix_layers < self.settings.min_frozen:
            return 0
        return frozen_prefix_layers + 1

    def open(self, cached_blocks: int) -> None:
        """Create the shared store the first time blocks are cached (every rank must call, at a transition)."""
        if cached_blocks == 0 or self.store is not None:
            return
        example = example_inputs(self.train_set, self.max_length, self.env.device, rows=1)
        with torch.no_grad():
            activation = self.model.forward_range(example, 0, cached_blocks)
        text = self.train_set.task == TextDataset.task
        spec = spec_from_activation(activation, pad_to=self.max_length if text else None)
        store = open_node_store(self.env, self.train_samples + self.eval_samples, spec, self.settings)
        self.store = store
        self.training = FrozenPrefixCache(store)
        self.evaluation = FrozenPrefixCache(store)

    def prefix(self, batch: Batch, plan: LayoutPlan) -> Activation:
        """A training batch's activation after the plan's frozen blocks: from the store, or a no-grad forward."""
        inputs = tuple(to_device(t, self.env.device) for t in batch.inputs)
        if plan.cached_blocks and self.training is not None:
            return self.training.activation_at_boundary(self.model, inputs, batch.indices, plan.cached_blocks)
        if plan.frozen_blocks:
            with torch.no_grad():
                return self.model.forward_range(inputs, 0, plan.frozen_blocks)
        return inputs

    def evaluation_boundary(self, plan: LayoutPlan) -> int:
        """Blocks an evaluation batch can skip under ``plan``: the cached ones, once the store is open."""
        return plan.cached_blocks if self.evaluation is not None else 0

    def evaluation_prefix(self, inputs: Activation, indices: torch.Tensor, boundary: int) -> Activation:
        """An evaluation batch's activation at ``boundary``: as fixed as a training sample's, so from the same
        store. Every evaluation runs the same shards in the same batches, so this equals a plain forward."""
        assert self.evaluation is not None
        return self.evaluation.activation_at_boundary(self.model, inputs, indices + self.train_samples, boundary)

    def metrics(self) -> CacheMetrics | None:
        """The training cache's counters, once the store is open."""
        return self.training.metrics() if self.training is not None else None

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
