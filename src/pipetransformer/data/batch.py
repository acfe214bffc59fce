"""Batches keyed by sample index, and the dataset base every loader returns.

The trainer asks a dataset for whole batches by index (``get_batch``) instead of going through a
DataLoader: one tensor index op per input, no per-item Python collate. Every batch carries the
dataset indices of its rows because the elastic sampler and the activation cache key on them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Generic, NamedTuple, Self, TypeVar

import torch
from torch.utils.data import Dataset

__all__ = [
    "Batch",
    "DataSplits",
    "DatasetUnavailableError",
    "IndexedDataset",
    "Item",
    "SampleLimits",
    "at_most",
    "held_out_splits",
    "seeded_permutation",
    "split_off",
    "split_train_validation",
]

Item = tuple[int, tuple[torch.Tensor, ...], int]
"""One sample: ``(index, inputs, label)``; ``inputs`` has no batch dimension."""


class DatasetUnavailableError(RuntimeError):
    """A data set's files are not on this machine; the message says how to install or point to them."""


@dataclass(frozen=True)
class Batch:
    """Rows of a dataset: their indices, the model inputs (a block-sequence activation) and labels.

    Text inputs are ``(input_ids[B,T], attention_mask[B,T])`` int64; image inputs are
    ``(pixels[B,C,H,W],)`` float32; ``indices`` and ``labels`` are int64 ``[B]``.
    """

    indices: torch.Tensor
    inputs: tuple[torch.Tensor, ...]
    labels: torch.Tensor

    def __post_init__(self) -> None:
        rows = self.indices.shape[0]
        if self.labels.shape[0] != rows or any(t.shape[0] != rows for t in self.inputs):
            raise ValueError(
                f"batch tensors disagree on the number of rows: indices {rows}, labels {self.labels.shape[0]}, "
                f"inputs {[t.shape[0] for t in self.inputs]}; build every tensor from the same indices"
            )

    def __len__(self) -> int:
        return int(self.indices.shape[0])

    def split(self, parts: int) -> list[Batch]:
        """Cut into ``parts`` contiguous chunks whose sizes differ by at most one (larger chunks first).

        Used for micro-batches and data-parallel replicas, so an empty chunk is refused rather than
        handed to a pipeline stage.
        """
        if not 1 <= parts <= len(self):
            raise ValueError(f"cannot split a batch of {len(self)} rows into {parts} parts; use 1..{len(self)} parts")
        indices = torch.tensor_split(self.indices, parts)
        labels = torch.tensor_split(self.labels, parts)
        inputs = [torch.tensor_split(t, parts) for t in self.inputs]
        return [
            Batch(indices[i], tuple(chunks[i] for chunks in inputs), labels[i]) for i in range(parts)
        ]


def seeded_permutation(size: int, seed: int) -> torch.Tensor:
    """A permutation of ``0..size-1`` that depends only on ``seed`` (not on the global RNG state)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(size, generator=generator)


class IndexedDataset(Dataset[Item], ABC):
    """A classification dataset held as whole tensors, with dense sample indices ``0..len-1``.

    Items are ``(index, inputs, label)``. Derived datasets (``select``, ``subset``, splits) re-number
    their rows from 0, so a sample index is always a valid position in the dataset it came from.
    """

    task: ClassVar[str]

    def __init__(self, inputs: tuple[torch.Tensor, ...], labels: torch.Tensor, class_names: Sequence[str]) -> None:
        if labels.dim() == 0 or any(t.shape[0] != labels.shape[0] for t in inputs):
            raise ValueError(
                f"inputs have {[t.shape[0] for t in inputs]} rows but there are {labels.shape[:1]} labels; "
                "give one label per row"
            )
        self._check_labels(inputs, labels, class_names)
        self._inputs = inputs
        self.labels = labels
        self.class_names = tuple(class_names)

    def _check_labels(self, inputs: tuple[torch.Tensor, ...], labels: torch.Tensor, class_names: Sequence[str]) -> None:
        """A classification dataset's labels: one class id per row, each naming one of ``class_names``. A dataset
        whose rows carry other targets (a language model's next tokens) checks its own."""
        if labels.dtype != torch.int64 or labels.dim() != 1:
            raise ValueError(f"labels must be a 1-D int64 tensor, got {labels.dtype} with shape {tuple(labels.shape)}")
        if len(class_names) == 0:
            raise ValueError("a classification dataset needs at least one class name")
        if labels.numel() > 0 and (int(labels.min()) < 0 or int(labels.max()) >= len(class_names)):
            raise ValueError(
                f"labels must lie in 0..{len(class_names) - 1} (one per class name), "
                f"got {int(labels.min())}..{int(labels.max())}"
            )

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, index: int) -> Item:
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} is outside 0..{len(self) - 1}")
        return index, tuple(t[index] for t in self._inputs), int(self.labels[index])

    def get_batch(self, indices: Sequence[int] | torch.Tensor, pad_to: int | None = None) -> Batch:
        """The rows at ``indices`` as one batch, gathered with one index op per tensor.

        ``pad_to`` fixes the sequence length of text batches (see the subclass); image batches
        always have a fixed shape.
        """
        index = torch.as_tensor(indices, dtype=torch.int64)
        if index.dim() != 1 or index.numel() == 0:
            raise ValueError(f"get_batch needs a non-empty 1-D sequence of indices, got shape {tuple(index.shape)}")
        low, high = int(index.min()), int(index.max())
        if low < 0 or high >= len(self):
            raise IndexError(f"sample indices {low}..{high} fall outside 0..{len(self) - 1}")
        return Batch(index, self._gather_inputs(index, pad_to), self.labels[index])

    @abstractmethod
    def _gather_inputs(self, index: torch.Tensor, pad_to: int | None) -> tuple[torch.Tensor, ...]:
        """The model inputs of the rows at ``index`` (already validated)."""

    @abstractmethod
    def select(self, positions: torch.Tensor) -> Self:
        """A new dataset of the rows at ``positions``, in that order, re-numbered ``0..len(positions)-1``."""

    def subset(self, n: int, seed: int) -> Self:
        """The first ``n`` rows of a ``seed``-ed permutation, kept in their original relative order.

        Indices are re-numbered ``0..n-1`` (dense), not the original ones.
        """
        if not 1 <= n <= len(self):
            raise ValueError(f"subset size must be in 1..{len(self)}, got {n}")
        positions, _ = torch.sort(seeded_permutation(len(self), seed)[:n])
        return self.select(positions)


D = TypeVar("D", bound=IndexedDataset)


class DataSplits(NamedTuple, Generic[D]):
    """Train (what the model learns from), validation (evaluations during training, model selection, any
    tuning) and test (evaluated once, at the end: what results report); disjoint, each numbered from 0."""

    train: D
    validation: D
    test: D


class SampleLimits(NamedTuple):
    """At most this many rows of each split (``None``: all of it): ``data.max_*_samples``."""

    train: int | None = None
    validation: int | None = None
    test: int | None = None


def at_most(splits: DataSplits[D], limits: SampleLimits, seed: int) -> DataSplits[D]:
    """Each split cut to its limit: a ``seed``-ed subset (:meth:`IndexedDataset.subset`)."""
    return DataSplits(*(part if limit is None or limit >= len(part) else part.subset(limit, seed)
                        for part, limit in zip(splits, limits, strict=True)))


def split_off(dataset: D, fractions: tuple[float, ...], seed: int) -> tuple[D, ...]:
    """``(rest, part_1, ..., part_k)``: a fixed, ``seed``-ed random split into disjoint datasets, each re-numbered
    from 0, where part ``i`` has ``round(len * fractions[i])`` rows (at least one) and the rest keeps at least one.

    Rows keep their original relative order inside each part. The parts are cut from one seeded permutation in
    order, so adding a part after the others leaves the earlier ones unchanged.
    """
    if any(not 0.0 < f < 1.0 for f in fractions) or sum(fractions) >= 1.0:
        raise ValueError(f"held-out fractions {list(fractions)} must each be strictly between 0 and 1 and sum "
                         "to less than 1, so training keeps some rows")
    size = len(dataset)
    if size < len(fractions) + 1:
        raise ValueError(f"cannot split a dataset of {size} rows into {len(fractions) + 1} parts; it needs at least "
                         f"{len(fractions) + 1}")
    permutation = seeded_permutation(size, seed)
    parts: list[D] = []
    start = 0
    for index, fraction in enumerate(fractions):
        left_for_later = len(fractions) - index  # later parts and the rest keep a row each
        count = min(max(round(size * fraction), 1), size - start - left_for_later)
        positions, _ = torch.sort(permutation[start:start + count])
        parts.append(dataset.select(positions))
        start += count
    rest, _ = torch.sort(permutation[start:])
    return (dataset.select(rest), *parts)


def split_train_validation(dataset: D, validation_fraction: float, seed: int) -> tuple[D, D]:
    """A fixed, ``seed``-ed random split into disjoint ``(train, validation)`` datasets, each re-numbered from 0."""
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be strictly between 0 and 1, got {validation_fraction}")
    train, validation = split_off(dataset, (validation_fraction,), seed)
    return train, validation


def held_out_splits(dataset: D, validation_fraction: float, test_fraction: float, seed: int,
                    test: D | None = None) -> DataSplits[D]:
    """Train / validation / test from one labelled set (``seed``-ed fractions of it), or, when the data set has
    its own ``test`` split, validation carved from ``dataset`` and that test split kept as it is."""
    if test is not None:
        train, validation = split_off(dataset, (validation_fraction,), seed)
        return DataSplits(train, validation, test)
    train, test_part, validation = split_off(dataset, (test_fraction, validation_fraction), seed)
    return DataSplits(train, validation, test_part)
