"""Datasets by name, all offline: each returns ``(train, evaluation)`` indexed datasets with dense sample indices."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pipetransformer.data.batch import (
    Batch,
    DatasetUnavailableError,
    IndexedDataset,
    Item,
    seeded_permutation,
    split_train_validation,
)
from pipetransformer.data.images import (
    ImageDataset,
    load_digits_images,
    load_fashion_mnist,
    load_image_folder,
)
from pipetransformer.data.text import (
    DEFAULT_MAX_LENGTH,
    TextDataset,
    load_rotten_tomatoes,
    load_text_csv,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "DATASET_NAMES",
    "TEXT_DATASETS",
    "Batch",
    "DatasetUnavailableError",
    "ImageDataset",
    "IndexedDataset",
    "Item",
    "TextDataset",
    "load_datasets",
    "load_digits_images",
    "load_fashion_mnist",
    "load_image_folder",
    "load_rotten_tomatoes",
    "load_text_csv",
    "seeded_permutation",
    "split_train_validation",
]

TEXT_DATASETS = ("rotten_tomatoes", "text_csv")
IMAGE_DATASETS = ("fashion_mnist", "digits", "image_folder")
DATASET_NAMES = TEXT_DATASETS + IMAGE_DATASETS
PATH_DATASETS = ("text_csv", "image_folder")
DEFAULT_VALIDATION_FRACTION = 0.1


def load_datasets(
    name: str,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_length: int = DEFAULT_MAX_LENGTH,
    path: str | Path | None = None,
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
    seed: int = 0,
    max_train_samples: int | None = None,
    max_eval_samples: int | None = None,
) -> tuple[IndexedDataset, IndexedDataset]:
    """``(train, evaluation)`` for a data set name, optionally cut to seeded subsets (re-numbered from 0).

    Evaluation is a seeded validation split, except for ``fashion_mnist`` and an ``image_folder``
    with test files, whose own test split is used (``validation_fraction`` is then unused). For
    ``fashion_mnist``, ``path`` overrides the default Debian folder.
    """
    if name not in DATASET_NAMES:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASET_NAMES)}")
    if name in TEXT_DATASETS and tokenizer is None:
        raise ValueError(f"{name} is a text dataset: pass tokenizer= (the model's own Hugging Face tokenizer)")
    if name in PATH_DATASETS and path is None:
        raise ValueError(
            f"{name} reads your own files: pass path= (a CSV file for text_csv, a folder for image_folder)"
        )
    train: IndexedDataset
    evaluation: IndexedDataset
    if name == "rotten_tomatoes":
        assert tokenizer is not None
        train, evaluation = load_rotten_tomatoes(tokenizer, max_length, validation_fraction, seed)
    elif name == "text_csv":
        assert tokenizer is not None and path is not None
        train, evaluation = load_text_csv(
            path, tokenizer, max_length=max_length, validation_fraction=validation_fraction, seed=seed
        )
    elif name == "fashion_mnist":
        train, evaluation = load_fashion_mnist() if path is None else load_fashion_mnist(path)
    elif name == "digits":
        train, evaluation = load_digits_images(validation_fraction, seed)
    else:
        assert path is not None
        train, evaluation = load_image_folder(path, validation_fraction, seed)
    return _at_most(train, max_train_samples, seed), _at_most(evaluation, max_eval_samples, seed)


def _at_most(dataset: IndexedDataset, limit: int | None, seed: int) -> IndexedDataset:
    if limit is None or limit >= len(dataset):
        return dataset
    return dataset.subset(limit, seed)
