"""What a run learns: the head's width, the loss and the evaluation metric, handed to the trainer as data.

As a model's train spec is in torchtitan, a task is passed in, not written into the loop: the step
executors and the evaluator call it and never name a loss. ``classification()`` is what the CLI trains;
``regression()`` predicts one number per sample, an integer label's value (a digit's value from its
image); ``causal_lm()`` predicts every next token (``model.kind: decoder`` trains it); other heads (token
classification, ...) come through the Python API, ``train(config, task=...)``.
Its functions are module-level so a task can be sent to spawned worker processes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipetransformer.config import LANGUAGE_MODEL_KINDS
from pipetransformer.data.batch import IndexedDataset
from pipetransformer.data.corpus import IGNORED_TARGET

__all__ = ["Task", "causal_lm", "classification", "regression", "task_for"]

BatchSum = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(head output, targets) -> sum over the batch's rows``."""
BatchRows = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(head output, targets) -> one value per row`` (any dtype: the evaluator keeps them as float64)."""


@dataclass(frozen=True)
class Task:
    """``loss`` returns a sum over a batch's rows, never a mean: the trainer divides it by the global batch (so
    replicas and micro-batches simply add up), which keeps every layout exact. ``sample_metric`` returns one value
    per row; the evaluator averages them over the split and keeps the test split's per sample, so two runs can be
    compared sample by sample (their difference's error from the test set's own sampling)."""

    metric: str  # its name in records and the summary: eval_<metric>, test_<metric>, ...
    higher_is_better: bool  # picks the best validation (the weights tested at the end)
    outputs: Callable[[IndexedDataset], int]  # the head's width for a training set
    targets: Callable[[torch.Tensor], torch.Tensor]  # a batch's dataset labels -> what loss and metric compare with
    loss: BatchSum
    sample_metric: BatchRows

    def better(self, value: float, than: float | None) -> bool:
        """Whether ``value`` improves on ``than`` (``None``: nothing measured yet)."""
        if than is None:
            return True
        return value > than if self.higher_is_better else value < than

    def best(self, values: Iterable[float]) -> float | None:
        values = list(values)
        if not values:
            return None
        return max(values) if self.higher_is_better else min(values)


def _class_count(dataset: IndexedDataset) -> int:
    return dataset.num_classes


def _class_ids(labels: torch.Tensor) -> torch.Tensor:
    return labels


def _cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets, reduction="sum")


def _correct(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1) == targets


def classification() -> Task:
    """One logit per class, cross-entropy, accuracy."""
    return Task(metric="accuracy", higher_is_better=True, outputs=_class_count, targets=_class_ids,
                loss=_cross_entropy_sum, sample_metric=_correct)


def _one_output(dataset: IndexedDataset) -> int:
    return 1


def _label_values(labels: torch.Tensor) -> torch.Tensor:
    return labels.to(torch.float32)


def _squared_error_sum(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(outputs.squeeze(-1), targets, reduction="sum")


def _absolute_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.squeeze(-1) - targets).abs()


def regression() -> Task:
    """One output, the label's value as a float target, squared error as the loss, mean absolute error (``mae``,
    lower is better) as the metric: it reads in the label's own units."""
    return Task(metric="mae", higher_is_better=False, outputs=_one_output, targets=_label_values,
                loss=_squared_error_sum, sample_metric=_absolute_error)


def _token_cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORED_TARGET, reduction="sum")


def _token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's mean negative log-likelihood of its next tokens, in nats."""
    losses = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORED_TARGET, reduction="none")
    counted = (targets != IGNORED_TARGET).sum(dim=1).clamp(min=1)
    return losses.sum(dim=1) / counted


def causal_lm() -> Task:
    """Next-token prediction: logits ``[B, T, vocab]`` against targets ``[B, T]``; the loss sums over the tokens
    that have a target (a sum, so the global batch's divided by its rows is the same in any layout); the metric is
    each row's mean negative log-likelihood (``nll``, nats, lower is better; perplexity is its exponential)."""
    return Task(metric="nll", higher_is_better=False, outputs=_class_count, targets=_class_ids,
                loss=_token_cross_entropy_sum, sample_metric=_token_nll)


def task_for(model_kind: str) -> Task:
    """What a config's model learns: a decoder predicts the next token, every other model classifies."""
    return causal_lm() if model_kind in LANGUAGE_MODEL_KINDS else classification()
