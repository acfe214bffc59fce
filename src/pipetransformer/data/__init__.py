"""Datasets by name, all offline: each returns train / validation / test indexed datasets with dense sample indices."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pipetransformer.data.batch import (
    Batch,
    DataSplits,
    DatasetUnavailableError,
    IndexedDataset,
    Item,
    SampleLimits,
    at_most,
    held_out_splits,
    seeded_permutation,
    split_off,
    split_train_validation,
)
from pipetransformer.data.images import (
    FASHION_MNIST_ROOT,
    ImageDataset,
    load_digits_images,
    load_fashion_mnist,
    load_image_folder,
)
from pipetransformer.data.text import (
    DEFAULT_LABEL_COLUMN,
    DEFAULT_MAX_LENGTH,
    DEFAULT_TEXT_COLUMN,
    TextDataset,
    load_rotten_tomatoes,
    load_text_csv,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pipetransformer.config import DataConfig

__all__ = [
    "DATASET_NAMES",
    "TEXT_DATASETS",
    "Batch",
    "DataSplits",
    "DatasetUnavailableError",
    "ImageDataset",
    "IndexedDataset",
    "Item",
    "SampleLimits",
    "TextDataset",
    "at_most",
    "datasets_from_config",
    "held_out_splits",
    "load_datasets",
    "load_digits_images",
    "load_fashion_mnist",
    "load_image_folder",
    "load_rotten_tomatoes",
    "load_text_csv",
    "seeded_permutation",
    "small_split_warnings",
    "split_off",
    "split_train_validation",
]

TEXT_DATASETS = ("rotten_tomatoes", "text_csv")
IMAGE_DATASETS = ("fashion_mnist", "digits", "image_folder")
DATASET_NAMES = TEXT_DATASETS + IMAGE_DATASETS
PATH_DATASETS = ("text_csv", "image_folder")
DEFAULT_VALIDATION_FRACTION = 0.1
DEFAULT_TEST_FRACTION = 0.1
MIN_HELD_OUT_ROWS = 30
"""Below this, one sample moves a held-out accuracy by more than 3 points: say so before training."""

def load_datasets(
    name: str,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_length: int = DEFAULT_MAX_LENGTH,
    path: str | Path | None = None,
    test_path: str | Path | None = None,
    text_column: str = DEFAULT_TEXT_COLUMN,
    label_column: str = DEFAULT_LABEL_COLUMN,
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
    test_fraction: float = DEFAULT_TEST_FRACTION,
    seed: int = 0,
    max_train_samples: int | None = None,
    max_eval_samples: int | None = None,
    max_test_samples: int | None = None,
    image_shape: tuple[int, int, int] | None = None,
    encoding: str = "utf-8",
) -> DataSplits[IndexedDataset]:
    """Train / validation / test for a data set name, each optionally cut to a seeded subset (re-numbered from 0).

    Validation is always a ``seed``-ed fraction of the training data. Test is the data set's own test split where
    it has one (``fashion_mnist``, an ``image_folder`` with test files, ``text_csv`` with ``test_path``), otherwise
    another ``seed``-ed fraction (``test_fraction`` is then unused). ``seed`` fixes the split only: pass the same
    one for every training seed so every run is scored on the same test set. ``image_shape``: the model's
    ``(channels, size, size)``, which an ``image_folder`` of image files is converted to.
    """
    if name not in DATASET_NAMES:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASET_NAMES)}")
    if name in TEXT_DATASETS and tokenizer is None:
        raise ValueError(f"{name} is a text dataset: pass tokenizer= (the model's own Hugging Face tokenizer)")
    if name in PATH_DATASETS and path is None:
        raise ValueError(
            f"{name} reads your own files: pass path= (a CSV file for text_csv, a folder for image_folder)"
        )
    if test_path is not None and name != "text_csv":
        raise ValueError(f"data.test_path is for text_csv; {name} has its test split built in (or in its folder)")
    limits = SampleLimits(max_train_samples, max_eval_samples, max_test_samples)
    splits: DataSplits[IndexedDataset]
    if name == "rotten_tomatoes":  # text is cut to its limits before it is tokenized
        assert tokenizer is not None
        return load_rotten_tomatoes(tokenizer, max_length, validation_fraction, test_fraction, seed, limits)
    if name == "text_csv":
        assert tokenizer is not None and path is not None
        return load_text_csv(path, tokenizer, text_column=text_column, label_column=label_column,
                             max_length=max_length, validation_fraction=validation_fraction,
                             test_fraction=test_fraction, seed=seed, test_path=test_path, limits=limits,
                             encoding=encoding)
    if name == "fashion_mnist":
        splits = load_fashion_mnist(path or FASHION_MNIST_ROOT, validation_fraction, seed)
    elif name == "digits":
        splits = load_digits_images(validation_fraction, test_fraction, seed)
    else:
        assert path is not None
        splits = load_image_folder(path, validation_fraction, test_fraction, seed, image_shape)
    return at_most(splits, limits, seed)


def datasets_from_config(data: DataConfig, tokenizer: PreTrainedTokenizerBase | None,
                         image_shape: tuple[int, int, int] | None = None) -> DataSplits[IndexedDataset]:
    """``load_datasets`` with every setting of a config's ``data`` section (``image_shape``: the model's)."""
    return load_datasets(data.name, tokenizer=tokenizer, max_length=data.max_length, path=data.path,
                         test_path=data.test_path, text_column=data.text_column, label_column=data.label_column,
                         validation_fraction=data.validation_fraction, test_fraction=data.test_fraction,
                         seed=data.split_seed, max_train_samples=data.max_train_samples,
                         max_eval_samples=data.max_eval_samples, max_test_samples=data.max_test_samples,
                         image_shape=image_shape, encoding=data.encoding)


def small_split_warnings(splits: DataSplits[IndexedDataset]) -> list[str]:
    """One line per held-out split too small to measure accuracy well (the caller logs them once)."""
    return [f"data: the {name} split has only {len(split)} rows, so one sample moves its accuracy by "
            f"{100 / len(split):.1f} points; training goes on, but add data or raise {key}"
            for name, split, key in (("validation", splits.validation, "data.validation_fraction"),
                                     ("test", splits.test, "data.test_fraction"))
            if len(split) < MIN_HELD_OUT_ROWS]
