"""The task's metric of the current model on a split, sharded over every rank, each running the whole model.

Before an evaluation the blocks' owners give every rank the current weights (``ElasticLayout.share_model``);
each rank then evaluates every world-size-th sample, and the per-sample values are all-reduced. Validation
samples go through the frozen-prefix cache; the test split, evaluated once, does not.
"""

from __future__ import annotations

import logging
from dataclasses import KW_ONLY, dataclass
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


@dataclass(eq=False)
class Evaluator:
    """``layout`` and ``cache`` are optional: without them the model is taken as it is on every rank."""

    model: BlockSequence
    task: Task
    env: DistEnv
    _: KW_ONLY
    batch_size: int
    layout: ElasticLayout | None = None
    cache: AutoCache | None = None

    def evaluate(self, dataset: IndexedDataset, use_cache: bool = False) -> float:
        """The task's metric over ``dataset`` (every rank must call)."""
        return float(self.sample_metrics(dataset, use_cache).mean())

    def sample_metrics(self, dataset: IndexedDataset, use_cache: bool = False) -> torch.Tensor:
        """The task's metric of each sample of ``dataset``, in its order, on every rank (every rank must call): each
        rank fills in the samples it evaluated, zeros elsewhere, and the all-reduce sums the shards into place."""
        if self.layout is not None:
            self.layout.share_model()
        self.model.eval()
        values = torch.zeros(len(dataset), dtype=torch.float64)
        indices = list(range(self.env.rank, len(dataset), self.env.world_size))
        for start in range(0, len(indices), self.batch_size):
            chunk = indices[start:start + self.batch_size]
            batch = dataset.get_batch(chunk)
            outputs = self.outputs(batch, use_cache=use_cache)
            values[chunk] = self.task.sample_metric(outputs.cpu(), self.task.targets(batch.labels)).to(torch.float64)
        self.model.train()
        if self.env.distributed:
            dist.all_reduce(values)
        return values

    def test(self, dataset: IndexedDataset, best: Checkpoint | None
             ) -> tuple[dict[str, Any], dict[str, list[float] | None]]:
        """The test split's metric for the final model and, when they were kept, the best-validation weights
        (loaded into the model: call once, at the end); and the same per sample, in the split's order
        (``final``, ``at_best_validation``), which pairs two runs sample by sample."""
        metric = self.task.metric
        final = self.sample_metrics(dataset)
        samples: dict[str, list[float] | None] = {"final": final.tolist(), "at_best_validation": None}
        result: dict[str, Any] = {f"test_{metric}": float(final.mean()), "test_samples": len(dataset),
                                  f"test_{metric}_at_best_validation": None, "best_validation_step": None}
        if best is not None:
            with torch.no_grad():
                self.model.load_state_dict(best.weights)
            at_best = self.sample_metrics(dataset)
            result[f"test_{metric}_at_best_validation"] = float(at_best.mean())
            samples["at_best_validation"] = at_best.tolist()
            result["best_validation_step"] = best.step
        if self.env.is_main:
            logger.info("test %s %.4f (final model), %s at best validation", metric, result[f"test_{metric}"],
                        result[f"test_{metric}_at_best_validation"])
        return result, samples

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
