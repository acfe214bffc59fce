"""Text for a causal language model: documents split into train / validation / test, then packed into windows.

Each split's documents are encoded as UTF-8 bytes (a byte-level vocabulary: nothing to download, any text, exact
decoding), each ended by an end-of-text token, concatenated, and cut into windows of ``max_length + 1`` tokens that
overlap by one: a window's first ``max_length`` tokens are its input and its last ``max_length`` the targets, the
next token at every position. Windows are fixed once, so a sample's input is the same every epoch (the activation
cache needs that) and every position of every window has a target. Documents are split before packing, so no
window mixes training and held-out text; the last window of a split, shorter than the others, is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Self

import torch

from pipetransformer.data.batch import DataSplits, DatasetUnavailableError, SampleLimits, at_most, held_out_splits
from pipetransformer.data.text import (DEFAULT_ENCODING, DEFAULT_TEXT_COLUMN, TextDataset, _TableRows, read_csv,
                                       rotten_tomatoes_texts)

__all__ = ["BYTE_VOCABULARY", "END_OF_TEXT", "IGNORED_TARGET", "TokenWindows", "decode_bytes", "encode_bytes",
           "load_corpus"]

BYTE_VOCABULARY = 257
"""The 256 byte values and the end-of-text token."""
END_OF_TEXT = 256
IGNORED_TARGET = -100
"""A target the loss skips (``F.cross_entropy``'s ``ignore_index``); packed windows have none, padded ones would."""
CORPORA = ("rotten_tomatoes", "text_csv")


def encode_bytes(text: str) -> list[int]:
    """A text's UTF-8 bytes followed by the end-of-text token."""
    return [*text.encode("utf-8"), END_OF_TEXT]


def decode_bytes(tokens: Sequence[int]) -> str:
    """The text of byte tokens, stopping at the first end-of-text; a cut multi-byte character becomes U+FFFD."""
    data = bytearray()
    for token in tokens:
        if token == END_OF_TEXT:
            break
        data.append(token)
    return data.decode("utf-8", errors="replace")


class TokenWindows(TextDataset):
    """Packed windows for next-token prediction: ``input_ids`` and an all-ones ``attention_mask``, int64 ``[N, T]``;
    the labels are the targets, int64 ``[N, T]`` (the token after each input position). The head's width, the
    dataset's ``num_classes``, is the vocabulary's size."""

    def __init__(self, input_ids: torch.Tensor, targets: torch.Tensor, vocabulary: int = BYTE_VOCABULARY) -> None:
        self.vocabulary = vocabulary
        super().__init__(input_ids, torch.ones_like(input_ids), targets, (), END_OF_TEXT)

    def _check_labels(self, inputs: tuple[torch.Tensor, ...], labels: torch.Tensor, class_names: Sequence[str]) -> None:
        if labels.dtype != torch.int64 or labels.shape != inputs[0].shape:
            raise ValueError(f"targets must be int64 with the inputs' shape {tuple(inputs[0].shape)}, got "
                             f"{labels.dtype} {tuple(labels.shape)}")
        real = labels[labels != IGNORED_TARGET]
        if real.numel() and (int(real.min()) < 0 or int(real.max()) >= self.vocabulary):
            raise ValueError(f"targets must lie in 0..{self.vocabulary - 1} (or be {IGNORED_TARGET}, skipped)")

    @property
    def num_classes(self) -> int:
        return self.vocabulary

    def __getitem__(self, index: int) -> tuple[int, tuple[torch.Tensor, ...], torch.Tensor]:  # type: ignore[override]
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} is outside 0..{len(self) - 1}")
        return index, (self.input_ids[index], self.attention_mask[index]), self.labels[index]

    def select(self, positions: torch.Tensor) -> Self:
        return type(self)(self.input_ids[positions], self.labels[positions], self.vocabulary)

    @classmethod
    def packed(cls, documents: Sequence[str], max_length: int) -> TokenWindows:
        """``documents`` encoded, concatenated and cut into windows of ``max_length`` inputs and targets."""
        stream = torch.tensor([token for text in documents for token in encode_bytes(text)], dtype=torch.int64)
        windows = (stream.numel() - 1) // max_length
        if windows < 1:
            raise ValueError(f"{stream.numel()} tokens of text make no window of data.max_length={max_length} "
                             "inputs: add text or lower data.max_length")
        used = stream[:windows * max_length + 1]
        return cls(used[:-1].view(windows, max_length).clone(), used[1:].view(windows, max_length).clone())


def _texts(name: str, path: str | Path | None, text_column: str, encoding: str) -> list[str]:
    if name == "rotten_tomatoes":
        return rotten_tomatoes_texts()
    if name != "text_csv":
        raise ValueError(f"a language model trains on text: data.name must be one of {', '.join(CORPORA)}, not {name}")
    if path is None or not Path(path).is_file():
        raise DatasetUnavailableError(f"no CSV file at {path}; set data.path to a CSV with a column {text_column!r}")
    rows = read_csv(Path(path), (text_column,), "set data.text_column to the column holding the text", encoding)
    texts = [row[text_column] for _, row in rows if row[text_column].strip()]
    if not texts:
        raise ValueError(f"{path} has no text in column {text_column!r}; add rows")
    return texts


def load_corpus(name: str, *, max_length: int, path: str | Path | None = None, text_column: str = DEFAULT_TEXT_COLUMN,
                encoding: str = DEFAULT_ENCODING, validation_fraction: float = 0.1, test_fraction: float = 0.1,
                seed: int = 0, limits: SampleLimits = SampleLimits()) -> DataSplits[TokenWindows]:
    """Train / validation / test windows of a corpus (Rotten Tomatoes' snippets, or a CSV's text column): documents
    split by ``seed``-ed fractions, each split packed, then cut to its ``limits`` (in windows)."""
    texts = _texts(name, path, text_column, encoding)
    documents = _TableRows.of([0] * len(texts), ("text",))  # split like samples, before packing
    splits = held_out_splits(documents, validation_fraction, test_fraction, seed)
    packed = DataSplits(*(TokenWindows.packed([texts[row] for row in part.rows.tolist()], max_length)
                          for part in splits))
    return at_most(packed, limits, seed)
