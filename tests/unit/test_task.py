"""Tasks: the loss is a sum over the rows (so shards and micro-batches add up), the metric one value per row, and
which way is better."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from pipetransformer.train.task import classification, regression
from tiny import CLASSES, tiny_dataset


def test_classification_sums_cross_entropy_and_counts_correct_rows() -> None:
    task = classification()
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 1.0]])
    labels = torch.tensor([0, 2, 2])
    assert task.outputs(tiny_dataset()) == CLASSES
    assert torch.equal(task.targets(labels), labels)
    torch.testing.assert_close(task.loss(logits, labels), nn.functional.cross_entropy(logits, labels) * 3)
    halves = task.loss(logits[:1], labels[:1]) + task.loss(logits[1:], labels[1:])
    torch.testing.assert_close(halves, task.loss(logits, labels))
    assert task.sample_metric(logits, labels).tolist() == [1.0, 0.0, 1.0]
    assert task.metric == "accuracy" and task.better(0.6, 0.5) and not task.better(0.5, 0.5)
    assert task.best([0.5, 0.7, 0.6]) == 0.7 and task.best([]) is None


def test_regression_predicts_the_label_value_with_squared_error_and_reports_absolute_error() -> None:
    task = regression()
    outputs = torch.tensor([[1.0], [2.5], [7.0]])
    targets = task.targets(torch.tensor([1, 3, 9]))
    assert task.outputs(tiny_dataset()) == 1 and targets.dtype == torch.float32
    assert float(task.loss(outputs, targets)) == pytest.approx(0.0 + 0.25 + 4.0)
    assert task.sample_metric(outputs, targets).tolist() == pytest.approx([0.0, 0.5, 2.0])
    assert task.metric == "mae" and task.better(0.4, 0.5) and task.best([0.5, 0.3, 0.4]) == 0.3


@pytest.mark.parametrize("make", [classification, regression])
def test_a_task_can_be_sent_to_spawned_workers(make: object) -> None:
    task = make()  # type: ignore[operator]
    assert pickle.loads(pickle.dumps(task)) == task
