"""Text for a causal language model: documents split into train / validation / test, then packed into windows.

Each split's documents are encoded as UTF-8 bytes (a byte-level vocabulary: nothing to download, any text, exact
decoding), each ended by an end-of-text token, concatenated, and cut into windows of ``max_length + 1`` tokens that
overlap by one: a window's first ``max_length`` tokens are its input and its last ``max_length`` the targets, the
next token at every position. Windows are fixed once, so a sample's input is the same every epoch (the activation
cache needs that) and every position of every window has a target. Documents are split before packing, so no
window mixes training and held-out text; the last window of a split, shorter than the others, is dropped.

A Hugging Face decoder (``model.kind: hf_decoder``) reads its own tokenizer's ids instead of bytes, its end-of-text
being the tokenizer's ``eos_token``: a :class:`Vocabulary` says how text becomes ids and back.

Instruction data (``data.response_column``) is not packed: each row is one example, its prompt's bytes then its
response's and an end-of-text, right-padded to ``max_length`` (longer ones cut at the end). Its targets are the next
tokens of the response only; the prompt's and the padding's are ``IGNORED_TARGET``, so the loss and the metric read
what the model is taught to answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Self

import torch
import torch.nn.functional as F

from pipetransformer.data.batch import (Batch, DataSplits, DatasetUnavailableError, SampleLimits, at_most,
                                        held_out_splits)
from pipetransformer.data.text import (DEFAULT_ENCODING, DEFAULT_TEXT_COLUMN, TextDataset, _TableRows, read_csv,
                                       rotten_tomatoes_texts)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["BYTES", "BYTE_VOCABULARY", "END_OF_TEXT", "IGNORED_TARGET", "TokenWindows", "Vocabulary", "decode_bytes",
           "encode_bytes", "load_corpus", "tokenizer_vocabulary"]

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


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8"))


@dataclass(frozen=True)
class Vocabulary:
    """How a language model's text becomes token ids and back: ``encode`` gives a text's ids (no end-of-text),
    ``decode`` the text of ids, ``end_of_text`` ends every document (and pads instruction rows), ``size`` is the
    model's number of token rows (the head's width; at least every id ``encode`` gives)."""

    size: int
    end_of_text: int
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]


BYTES = Vocabulary(BYTE_VOCABULARY, END_OF_TEXT, _utf8, decode_bytes)
"""The built-in decoder's: UTF-8 bytes and one end-of-text token."""


@dataclass(frozen=True)
class _TokenizerCodec:
    """A Hugging Face tokenizer's encoding without special tokens (the corpus adds the end-of-text itself), and its
    decoding up to the first end-of-text."""

    tokenizer: PreTrainedTokenizerBase
    end_of_text: int

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, tokens: Sequence[int]) -> str:
        ids = list(tokens)
        if self.end_of_text in ids:
            ids = ids[:ids.index(self.end_of_text)]
        return str(self.tokenizer.decode(ids))


def tokenizer_vocabulary(tokenizer: PreTrainedTokenizerBase, size: int, where: str) -> Vocabulary:
    """A Hugging Face decoder's vocabulary: its tokenizer's ids, ``eos_token`` ending documents, ``size`` the model's
    token rows. A tokenizer without an end-of-text token, or with ids past the model's rows, is refused in one line."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"the tokenizer at {where} has no eos_token, which ends every document: set eos_token in its "
                         "tokenizer_config.json")
    if len(tokenizer) > size:
        raise ValueError(f"the tokenizer at {where} has {len(tokenizer)} tokens but the model {size} token rows "
                         "(vocab_size): use the tokenizer the model was trained with")
    codec = _TokenizerCodec(tokenizer, int(eos))
    return Vocabulary(size, int(eos), codec.encode, codec.decode)


class TokenWindows(TextDataset):
    """Rows for next-token prediction: ``input_ids`` and a right-padded ``attention_mask`` (all ones for packed
    windows), int64 ``[N, T]``; the labels are the targets, int64 ``[N, T]`` (the token after each input position, or
    ``IGNORED_TARGET``). The head's width, the dataset's ``num_classes``, is the vocabulary's size."""

    def __init__(self, input_ids: torch.Tensor, targets: torch.Tensor, vocabulary: int = BYTE_VOCABULARY,
                 attention_mask: torch.Tensor | None = None, pad_token_id: int = END_OF_TEXT) -> None:
        self.vocabulary = vocabulary
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        super().__init__(input_ids, mask, targets, (), pad_token_id)

    def get_batch(self, indices: Sequence[int] | torch.Tensor, pad_to: int | None = None) -> Batch:
        """The rows' inputs trimmed (or padded) as a text batch is, and their targets cut to the same width: padding
        positions past a row's end have no target."""
        batch = super().get_batch(indices, pad_to)
        width, stored = batch.inputs[0].shape[1], self.max_length
        targets = batch.labels[:, :width]
        if width > stored:
            targets = F.pad(targets, (0, width - stored), value=IGNORED_TARGET)
        return Batch(batch.indices, batch.inputs, targets)

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
        return type(self)(self.input_ids[positions], self.labels[positions], self.vocabulary,
                          self.attention_mask[positions], self.pad_token_id)

    @classmethod
    def packed(cls, documents: Sequence[str], max_length: int, vocabulary: Vocabulary = BYTES) -> TokenWindows:
        """``documents`` encoded, each ended by the end-of-text, concatenated and cut into windows of ``max_length``
        inputs and targets."""
        end = vocabulary.end_of_text
        stream = torch.tensor([token for text in documents for token in (*vocabulary.encode(text), end)],
                              dtype=torch.int64)
        windows = (stream.numel() - 1) // max_length
        if windows < 1:
            raise ValueError(f"{stream.numel()} tokens of text make no window of data.max_length={max_length} "
                             "inputs: add text or lower data.max_length")
        used = stream[:windows * max_length + 1]
        return cls(used[:-1].view(windows, max_length).clone(), used[1:].view(windows, max_length).clone(),
                   vocabulary.size, pad_token_id=end)

    @classmethod
    def examples(cls, prompts: Sequence[str], responses: Sequence[str], max_length: int,
                 vocabulary: Vocabulary = BYTES) -> TokenWindows:
        """One row per prompt and response, right-padded to ``max_length``; targets on the response only. An example
        whose prompt fills the window leaves no response token to learn and is left out (a metric of nothing would
        read as a perfect 0). Prompt and response are encoded apart, so the prompt's last token is the same whatever
        answers it."""
        end = vocabulary.end_of_text
        rows, targets = [], []
        for prompt, response in zip(prompts, responses, strict=True):
            prompt_tokens = vocabulary.encode(prompt)
            if len(prompt_tokens) > max_length:
                continue
            tokens = [*prompt_tokens, *vocabulary.encode(response), end][:max_length + 1]
            answered = max(len(prompt_tokens) - 1, 0)  # the last prompt token predicts the response's first
            rows.append(tokens[:-1])
            targets.append([IGNORED_TARGET] * answered + tokens[1 + answered:])
        if not rows:
            raise ValueError(f"no response fits data.max_length={max_length} after its prompt: raise "
                             "data.max_length or shorten the prompts")
        ids = torch.full((len(rows), max_length), end, dtype=torch.int64)
        mask = torch.zeros((len(rows), max_length), dtype=torch.int64)
        labels = torch.full((len(rows), max_length), IGNORED_TARGET, dtype=torch.int64)
        for row, (tokens, target) in enumerate(zip(rows, targets, strict=True)):
            ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
            mask[row, :len(tokens)] = 1
            labels[row, :len(target)] = torch.tensor(target, dtype=torch.int64)
        return cls(ids, labels, vocabulary.size, attention_mask=mask, pad_token_id=end)


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


def _instructions(path: str | Path | None, prompt_column: str, response_column: str,
                  encoding: str) -> tuple[list[str], list[str]]:
    if path is None or not Path(path).is_file():
        raise DatasetUnavailableError(f"no CSV file at {path}; set data.path to a CSV with columns {prompt_column!r} "
                                      f"and {response_column!r}")
    rows = read_csv(Path(path), (prompt_column, response_column), "set data.text_column to the prompts' column and "
                    "data.response_column to the responses'", encoding)
    kept = [(row[prompt_column], row[response_column]) for _, row in rows if row[response_column].strip()]
    if not kept:
        raise ValueError(f"{path} has no response in column {response_column!r}; add rows")
    return [prompt for prompt, _ in kept], [response for _, response in kept]


def load_corpus(name: str, *, max_length: int, path: str | Path | None = None, text_column: str = DEFAULT_TEXT_COLUMN,
                response_column: str | None = None, encoding: str = DEFAULT_ENCODING,
                validation_fraction: float = 0.1, test_fraction: float = 0.1, seed: int = 0,
                limits: SampleLimits = SampleLimits(), vocabulary: Vocabulary = BYTES) -> DataSplits[TokenWindows]:
    """Train / validation / test windows of a corpus (Rotten Tomatoes' snippets, or a CSV's text column): documents
    split by ``seed``-ed fractions, each split packed, then cut to its ``limits`` (in windows). With
    ``response_column`` (a CSV of prompts and responses) each row is one example instead
    (:meth:`TokenWindows.examples`)."""
    if response_column is not None:
        prompts, responses = _instructions(path, text_column, response_column, encoding)
        table = _TableRows.of([0] * len(prompts), ("example",))
        splits = held_out_splits(table, validation_fraction, test_fraction, seed)
        return at_most(DataSplits(*(TokenWindows.examples([prompts[r] for r in part.rows.tolist()],
                                                          [responses[r] for r in part.rows.tolist()], max_length,
                                                          vocabulary)
                                    for part in splits)), limits, seed)
    texts = _texts(name, path, text_column, encoding)
    documents = _TableRows.of([0] * len(texts), ("text",))  # split like samples, before packing
    splits = held_out_splits(documents, validation_fraction, test_fraction, seed)
    packed = DataSplits(*(TokenWindows.packed([texts[row] for row in part.rows.tolist()], max_length, vocabulary)
                          for part in splits))
    return at_most(packed, limits, seed)
