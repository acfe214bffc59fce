"""Serve a batch's activation at the frozen boundary from the store, computing only what is missing.

With blocks ``0 .. b-1`` frozen (eval mode, no grad), a sample's output of block ``b-1`` never changes,
so it is computed once and reused in later epochs. When more blocks freeze (``b0 -> b``), a record
at ``b0`` is advanced by running only blocks ``b0 .. b-1`` on it, lazily, when its sample comes again.

Exactness: a sample's activation is computed within the batch it came in. Served again in a batch of
the same composition, it equals a plain forward bit for bit. Mixed with samples of other batches,
a text batch may be padded to another length and a sub-batch has another size, so matrix products
may round differently (about 1e-6 relative); positions past a sample's real length are padding,
hold zeros when the record was shorter than this batch, and are ignored by every later block
through the attention mask.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from pipetransformer.cache.store import EMPTY_BOUNDARY, ActivationStore
from pipetransformer.models.blocks import Activation, BlockSequence, as_activation

__all__ = ["CacheMetrics", "FrozenPrefixCache"]

_TEXT_TASK = "text"
_SEQUENCE_DIM = 1


@dataclass(frozen=True)
class CacheMetrics:
    """What the cache did in this process; ``seconds_saved`` is an estimate from measured block times."""

    samples: int
    hits: int
    advanced: int
    computed: int
    bypassed: int
    corrupt: int
    memory_used_bytes: int
    disk_used_bytes: int
    seconds_saved: float

    @property
    def hit_rate(self) -> float:
        """Share of served samples that skipped at least part of the frozen forward."""
        return (self.hits + self.advanced) / self.samples if self.samples else 0.0


def _rows(activation: Activation, rows: torch.Tensor, device: torch.device | None = None) -> Activation:
    """``rows`` (host indices) of each tensor, on ``device`` (default: where each tensor is)."""
    return tuple(t.index_select(0, rows.to(t.device)).to(device or t.device) for t in activation)


class FrozenPrefixCache:
    """The frozen prefix of a :class:`BlockSequence`, served from an :class:`ActivationStore`.

    A sample's inputs must be the same every epoch (no random augmentation): its record is reused as is.
    A store without a memory level (it could not be created) is bypassed: every sample is computed.
    """

    def __init__(self, store: ActivationStore) -> None:
        self.store = store
        self._hits_at: dict[int, int] = defaultdict(int)
        self._advanced_from: dict[int, int] = defaultdict(int)
        self._samples = 0
        self._computed = 0
        self._bypassed = 0
        self._block_seconds: dict[int, float] = defaultdict(float)
        self._block_samples: dict[int, int] = defaultdict(int)

    def _run(self, model: BlockSequence, activation: Activation, start: int, end: int) -> Activation:
        """Blocks ``start .. end-1``, timing each one per sample for the savings estimate."""
        samples = activation[0].shape[0]
        for index in range(start, end):
            began = time.perf_counter()
            activation = as_activation(model.blocks[index](*activation))
            self._block_seconds[index] += time.perf_counter() - began
            self._block_samples[index] += samples
        return activation

    @staticmethod
    def _check_frozen(model: BlockSequence, boundary: int) -> None:
        if not 0 <= boundary < len(model):
            raise ValueError(f"boundary={boundary} must lie in [0, {len(model)}): the head is never cached")
        for index in range(boundary):
            block = model.blocks[index]
            if any(m.training for m in block.modules()) or any(p.requires_grad for p in block.parameters()):
                raise ValueError(
                    f"block {index} is not frozen (training mode or trainable parameters); "
                    "freeze blocks before serving them from the cache"
                )

    def activation_at_boundary(
        self,
        model: BlockSequence,
        batch_inputs: Activation,
        indices: torch.Tensor,
        boundary: int,
    ) -> Activation:
        """Output of blocks ``0 .. boundary-1`` for the batch of dataset samples ``indices``."""
        self._check_frozen(model, boundary)
        if boundary == 0:
            return batch_inputs
        with torch.no_grad():
            if not self.store.enabled:
                self._bypassed += indices.numel()
                return self._run(model, batch_inputs, 0, boundary)
            return self._serve(model, batch_inputs, indices.reshape(-1).to(torch.long), boundary)

    def _serve(self, model: BlockSequence, batch_inputs: Activation, idx: torch.Tensor, boundary: int) -> Activation:
        batch = idx.numel()
        device = batch_inputs[0].device  # the model's; the store and the indices live on the host
        trim_to = batch_inputs[0].shape[_SEQUENCE_DIM] if model.task == _TEXT_TASK else None
        recorded = self.store.lookup(idx)
        usable = (recorded != EMPTY_BOUNDARY) & (recorded <= boundary)
        parts: list[tuple[torch.Tensor, Activation]] = []
        missing = ~usable
        rows_with_record = usable.nonzero().reshape(-1)
        if rows_with_record.numel():
            read = self.store.read(idx[rows_with_record], trim_to=trim_to)
            missing[rows_with_record[~read.served]] = True
            for start in torch.unique(read.boundaries[read.served]).tolist():
                chosen = read.served & (read.boundaries == start)
                rows = rows_with_record[chosen]
                activation = _rows(read.activation, chosen.nonzero().reshape(-1), device)
                if start == boundary:
                    self._hits_at[boundary] += rows.numel()
                else:
                    activation = self._run(model, activation, start, boundary)
                    self.store.write(idx[rows], activation, boundary)
                    self._advanced_from[start] += rows.numel()
                parts.append((rows, activation))
        rows = missing.nonzero().reshape(-1)
        if rows.numel():
            inputs = batch_inputs if rows.numel() == batch else _rows(batch_inputs, rows)
            activation = self._run(model, inputs, 0, boundary)
            self.store.write(idx[rows], activation, boundary)
            self._computed += rows.numel()
            parts.append((rows, activation))
        self._samples += batch
        if len(parts) == 1 and parts[0][0].numel() == batch and torch.equal(parts[0][0], torch.arange(batch)):
            return parts[0][1]
        return self._assemble(parts, batch)

    @staticmethod
    def _assemble(parts: list[tuple[torch.Tensor, Activation]], batch: int) -> Activation:
        template = parts[0][1]
        out = [torch.empty((batch, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in template]
        for rows, activation in parts:
            for target, value in zip(out, activation, strict=True):
                target.index_copy_(0, rows.to(target.device), value)
        return tuple(out)

    def _prefix_seconds(self, boundary: int) -> float:
        """Estimated seconds one sample spends in blocks ``0 .. boundary-1``."""
        return sum(
            self._block_seconds[i] / self._block_samples[i] for i in range(boundary) if self._block_samples[i]
        )

    def metrics(self) -> CacheMetrics:
        stats = self.store.stats()
        saved = sum(count * self._prefix_seconds(b) for b, count in self._hits_at.items())
        saved += sum(count * self._prefix_seconds(b0) for b0, count in self._advanced_from.items())
        return CacheMetrics(
            samples=self._samples + self._bypassed,
            hits=sum(self._hits_at.values()),
            advanced=sum(self._advanced_from.values()),
            computed=self._computed,
            bypassed=self._bypassed,
            corrupt=stats.corrupt,
            memory_used_bytes=stats.memory_used_bytes,
            disk_used_bytes=stats.disk_used_bytes,
            seconds_saved=saved,
        )
