"""The Evaluator on a fixed model (one process, no layout): the task's metric over every sample, in batches."""

from __future__ import annotations

import pytest
import torch

from pipetransformer.train.evaluator import Evaluator
from pipetransformer.train.task import classification, regression
from tiny import ROWS, env, tiny_dataset, tiny_model

BATCH = 5  # ROWS is not a multiple: the last batch is short


def test_accuracy_counts_every_sample_once_and_leaves_the_model_training() -> None:
    model, dataset = tiny_model(), tiny_dataset()
    model.train()
    with torch.no_grad():
        expected = float((model(*dataset.get_batch(list(range(ROWS))).inputs).argmax(-1) == dataset.labels).double()
                         .mean())
    accuracy = Evaluator(model, classification(), env(), batch_size=BATCH).evaluate(dataset)
    assert accuracy == pytest.approx(expected, abs=1e-12) and 0.0 < accuracy < 1.0
    assert model.training


def test_a_regression_is_scored_by_mean_absolute_error() -> None:
    model, dataset = tiny_model(outputs=1), tiny_dataset()
    with torch.no_grad():
        predictions = model(*dataset.get_batch(list(range(ROWS))).inputs).squeeze(-1)
    expected = float((predictions - dataset.labels.float()).abs().mean())
    mae = Evaluator(model, regression(), env(), batch_size=BATCH).evaluate(dataset)
    assert mae == pytest.approx(expected, rel=1e-6)


def test_sample_metrics_are_each_samples_metric_in_the_datasets_order() -> None:
    model, dataset = tiny_model(), tiny_dataset()
    with torch.no_grad():
        logits = model(*dataset.get_batch(list(range(ROWS))).inputs)
    expected = (logits.argmax(-1) == dataset.labels).double()
    values = Evaluator(model, classification(), env(), batch_size=BATCH).sample_metrics(dataset)
    assert torch.equal(values, expected) and 0 < int(values.sum()) < ROWS


def test_test_reports_the_final_model_alone_when_no_best_weights_were_kept() -> None:
    evaluator = Evaluator(tiny_model(), classification(), env(), batch_size=BATCH)
    result, samples = evaluator.test(tiny_dataset(), best=None)
    assert result["test_samples"] == ROWS and result["test_accuracy_at_best_validation"] is None
    assert result["best_validation_step"] is None and 0.0 <= result["test_accuracy"] <= 1.0
    assert samples["at_best_validation"] is None and len(samples["final"]) == ROWS
    assert sum(samples["final"]) / ROWS == pytest.approx(result["test_accuracy"], abs=1e-12)
