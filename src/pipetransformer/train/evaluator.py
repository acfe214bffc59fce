"""The task's metric of the current model on a split, sharded over every rank, each running the whole model.

Before an evaluation the blocks' owners give every rank the current weights (``ElasticLayout.share_model``);
each rank then evaluates every world-size-th sample, and the sums are all-reduced. Validation samples go
through the frozen-prefix cache; the test split, evaluated once, does not.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from pipetransformer.checkpoint import Checkpoint
from pipetransformer.data.batch import Batch, IndexedDataset
from pipetransformer.distributed import DistEnv
from pipetransformer.models.blocks import BlockSequence
from pipetransformer.train.autocache import AutoCache
from pipetransformer.train.elastic import ElasticLayout
from pipetransformer.train.task import Task

__all__ = ["Evaluator"]

logger = logging.getLogger(__name__)


class Evaluator:
    """``layout`` and ``cache`` are optional: without them the model is taken as it is on every rank."""

    def __init__(self, model: BlockSequence, task: Task, env: DistEnv, *, batch_size: int,
                 layout: ElasticLayout | None = None, cache: AutoCache | None = None) -> None:
        self.model = model
        self.task = task
        self.env = env
        self.batch_size = batch_size
        self.layout = layout
        self.cache = cache

    def evaluate(self, dataset: IndexedDataset, use_cache: bool = False) -> float:
        """The task's metric over ``dataset`` (every rank must call)."""
        if self.layout is not None:
            self.layout.share_model()
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64)  # metric sum, samples
        indices = list(range(self.env.rank, len(dataset), self.env.world_size))
        for start in range(0, len(indices), self.batch_size):
            batch = dataset.get_batch(indices[start:start + self.batch_size])
            outputs = self.outputs(batch, use_cache=use_cache)
            totals[0] += float(self.task.metric_sum(outputs.cpu(), self.task.targets(batch.labels)))
            totals[1] += len(batch)
        self.model.train()
        if self.env.distributed:
            dist.all_reduce(totals)
        return float(totals[0] / totals[1])

    def test(self, dataset: IndexedDataset, best: Checkpoint | None) -> dict[str, Any]:
        """The test split's metric for the final model and, when they were kept, the best-validation weights
        (loaded into the model: call once, at the end)."""
        metric = self.task.metric
        result: dict[str, Any] = {f"test_{metric}": self.evaluate(dataset), "test_samples": len(dataset),
                                  f"test_{metric}_at_best_validation": None, "best_validation_step": None}
        if best is not None:
            with torch.no_grad():
                self.model.load_state_dict(best.weights)
            result[f"test_{metric}_at_best_validation"] = self.evaluate(dataset)
            result["best_validation_step"] = best.step
        if self.env.is_main:
            logger.info("test %s %.4f (final model), %s at best validation", metric, result[f"test_{metric}"],
                        result[f"test_{metric}_at_best_validation"])
        return result

    @torch.no_grad()
    def outputs(self, batch: Batch, use_cache: bool = True) -> torch.Tensor:
        """The head's output for an evaluation batch from this rank's whole model (call in eval mode); with
        ``use_cache`` the frozen prefix's output comes from the cache where the layout caches it."""
        activation = tuple(t.to(self.env.device) for t in batch.inputs)
        boundary = 0
        if use_cache and self.cache is not None and self.layout is not None:
            boundary = self.cache.evaluation_boundary(self.layout.plan)
        if boundary:
            assert self.cache is not None
            activation = self.cache.evaluation_prefix(activation, batch.indices, boundary)
        return self.model.forward_range(activation, boundary, len(self.model))[0]
