"""Cost model of blocks and pipeline stages: what AutoPipe balances.

A block is measured once per *sample* (:class:`BlockCost`); its cost in a stage then depends on its
state (trainable, frozen, or frozen with its output served from the cache) and on the micro-batch
size. Everything here is plain arithmetic so the partitioner can be tested exhaustively without torch.

Without a device to measure on, :func:`analytic_work` describes a block by its work per sample
(FLOPs, bytes moved, parameters, saved activations: :class:`BlockWork`) and :func:`costs_from_work`
turns that into a :class:`BlockCost` for a device's sustained FLOP/s and memory bandwidth and a
precision. The two memory savers change a cost the same way for measured and analytic blocks: bf16
(:func:`costs_from_work`) halves activations and messages and runs at the device's bf16 rate;
recomputation (:func:`recomputed`) keeps only a block's input and pays one more forward in backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum

__all__ = [
    "ADAMW_STATE_FACTOR",
    "SGD_MOMENTUM_STATE_FACTOR",
    "BlockCost",
    "BlockState",
    "BlockWork",
    "Link",
    "Precision",
    "StageTiming",
    "block_states",
    "analytic_costs",
    "as_trained",
    "analytic_work",
    "block_forward_seconds",
    "block_memory",
    "block_seconds",
    "costs_from_work",
    "recomputed",
    "stage_memory",
    "stage_time",
    "stage_timing",
    "transfer_time",
    "validate_states",
]

ADAMW_STATE_FACTOR = 2
"""AdamW keeps two tensors (first and second moments) the size of the parameters."""

SGD_MOMENTUM_STATE_FACTOR = 1
"""SGD with momentum keeps one tensor (the momentum buffer) the size of the parameters."""

FLOAT_BYTES = 4
BF16_BYTES = 2
MASK_ELEMENT_BYTES = 8
"""The attention mask travels as int64 beside the hidden states."""

FLOPS_PER_MULTIPLY_ADD = 2
BACKWARD_TO_FORWARD_FLOPS = 2.0
"""Backward computes gradients of inputs and of weights: about twice the forward FLOPs."""

ATTENTION_PROJECTIONS = 4
"""Query, key, value and output projections: four hidden x hidden matrices per layer."""

MLP_MATRICES = 2
LAYER_NORMS_PER_LAYER = 2
PARAMS_PER_LAYER_NORM_FEATURE = 2
ELEMENTWISE_FLOPS_PER_FEATURE = 10
"""Rough FLOPs per hidden feature of the cheap parts (norms, residuals, lookups, pooling)."""

SAVED_HIDDEN_TENSORS_PER_LAYER = 8
"""Hidden-sized tensors a layer keeps for backward: 2 norm inputs, q, k, v, context, 2 projection inputs."""

SAVED_MLP_TENSORS_PER_LAYER = 2
"""MLP-sized tensors kept for backward: the activation function's input and output."""

SAVED_ATTENTION_MAPS_PER_HEAD = 2
"""Attention probabilities and their dropout mask, each seq x seq per head."""

MEMORY_PASSES_PER_SAVED_ELEMENT = 2
"""Device-memory traffic of the memory-bound parts (norms, softmax, activation functions, dropout,
residuals): each saved element is written once and read once in the forward. Matmuls are counted
by their FLOPs only."""


class Precision(Enum):
    """Numeric format of activations and of the arithmetic; weights, gradients and optimizer state stay fp32
    (mixed precision: bf16 autocast over fp32 master weights)."""

    FP32 = "fp32"
    BF16 = "bf16"

    @property
    def activation_bytes(self) -> int:
        return BF16_BYTES if self is Precision.BF16 else FLOAT_BYTES


class BlockState(Enum):
    """How a block takes part in training; freezing and caching both grow from the bottom up."""

    CACHED = "cached"
    FROZEN = "frozen"
    ACTIVE = "active"


def block_states(num_blocks: int, frozen_blocks: int, cached_blocks: int) -> list[BlockState]:
    """The leading ``cached_blocks`` cached, the rest of the ``frozen_blocks`` frozen, the others active."""
    return [BlockState.CACHED if i < cached_blocks else BlockState.FROZEN if i < frozen_blocks else BlockState.ACTIVE
            for i in range(num_blocks)]


_STATE_ORDER = {BlockState.CACHED: 0, BlockState.FROZEN: 1, BlockState.ACTIVE: 2}


@dataclass(frozen=True)
class BlockCost:
    """One block's measured or estimated cost, per sample (see :func:`analytic_costs`).

    ``recompute_bytes`` is non-zero only for a recomputed block (:func:`recomputed`): the activations it
    rebuilds during its backward, held for one micro-batch at a time on top of what the stage keeps.
    ``forward_fixed_s`` and ``backward_fixed_s`` are paid once per call whatever its size (kernel launches,
    an embedding table's dense gradient): what makes many small micro-batches dearer than few large ones.
    Profiling measures them (:func:`~pipetransformer.pipe.profile.profile_blocks`); analytic costs leave them
    at 0 and count such costs per micro-batch and stage instead.
    ``frozen_forward_s`` and ``frozen_forward_fixed_s`` are the forward of the block frozen: in eval mode (no
    dropout) and recording no autograd graph, as the trainer runs frozen blocks; a MiniLM layer on one CPU thread
    took ~20% less than training it forward. None (analytic costs) counts the training forward.
    ``row_summed_bytes`` are the bytes of the block's vocabulary tables, whose gradients replicas may sum by the rows
    their batches touched (``dp.touched_rows_only``), and ``touched_row_bytes_per_sample`` the rows one sample's ids
    can touch; analytic costs leave both 0 (every parameter all-reduced whole).
    ``input_grad_share`` is the share of the backward that computes the gradient of the block's input: the lowest
    trainable block skips it, since nothing below trains (:func:`as_trained`). A MiniLM layer's was ~1/8; the
    first block is profiled without it (the model's inputs never need one); analytic costs leave it 0.
    """

    forward_s: float
    backward_s: float
    output_bytes: int
    param_bytes: int
    activation_bytes: int
    recompute_bytes: int = 0
    forward_fixed_s: float = 0.0
    backward_fixed_s: float = 0.0
    frozen_forward_s: float | None = None
    frozen_forward_fixed_s: float | None = None
    row_summed_bytes: int = 0
    touched_row_bytes_per_sample: int = 0
    input_grad_share: float = 0.0

    def seconds(self, samples: int) -> tuple[float, float]:
        """(forward, backward) seconds of one call on ``samples`` samples, training the block."""
        return (self.forward_s * samples + self.forward_fixed_s, self.backward_s * samples + self.backward_fixed_s)

    @property
    def frozen_forward(self) -> tuple[float, float]:
        """(seconds per sample, seconds per call) of the frozen block's forward."""
        if self.frozen_forward_s is None or self.frozen_forward_fixed_s is None:
            return self.forward_s, self.forward_fixed_s
        return self.frozen_forward_s, self.frozen_forward_fixed_s

    def frozen_seconds(self, samples: int) -> float:
        """Seconds of one frozen forward on ``samples`` samples."""
        per_sample, per_call = self.frozen_forward
        return per_sample * samples + per_call

    def allreduce_bytes(self, touched_by: int | None) -> tuple[int, int]:
        """(bytes all-reduced in buckets, bytes of touched table rows) a step: with ``touched_by`` None every
        parameter goes whole into buckets; else tables are summed by the rows ``touched_by`` samples (the step's,
        over every replica) can touch, at most the whole table."""
        if touched_by is None or not self.row_summed_bytes:
            return self.param_bytes, 0
        rows = min(self.row_summed_bytes, self.touched_row_bytes_per_sample * touched_by)
        return self.param_bytes - self.row_summed_bytes, rows


@dataclass(frozen=True)
class BlockWork:
    """One block's work per sample, independent of any device (see :func:`analytic_work`).

    Activations are counted in elements so a precision can size them; parameters stay fp32.
    """

    forward_flops: float
    memory_elements: float  # elements the memory-bound parts of the forward read and write
    params: int
    saved_elements: int  # float elements kept for backward
    output_elements: int  # float elements sent to the next block
    output_extra_bytes: int = 0  # non-float bytes beside them (the int64 attention mask)

    def output_bytes(self, precision: Precision) -> int:
        return self.output_elements * precision.activation_bytes + self.output_extra_bytes


@dataclass(frozen=True)
class Link:
    """The connection between two neighbouring stages."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(
                f"link bandwidth must be > 0 bytes/s (math.inf for a free link), got {self.bandwidth_bytes_per_s}"
            )
        if self.latency_s < 0:
            raise ValueError(f"link latency must be >= 0 s, got {self.latency_s}")


@dataclass(frozen=True)
class StageTiming:
    """A stage's time for one micro-batch as ``seconds_per_sample * micro_batch_size + fixed_s``.

    Kept in two parts because message latency does not shrink with the micro-batch, which is what
    makes very small micro-batches a bad deal.
    """

    seconds_per_sample: float
    fixed_s: float

    def at(self, micro_batch_size: int) -> float:
        return self.seconds_per_sample * micro_batch_size + self.fixed_s


def validate_states(costs: Sequence[BlockCost], states: Sequence[BlockState]) -> None:
    """Cached blocks, then frozen ones, then trainable ones: the cost model relies on that order.

    A frozen block above a trainable one would still need a backward pass for its input gradient,
    which the "forward only" cost of a frozen block does not include.
    """
    if len(costs) != len(states):
        raise ValueError(f"got {len(costs)} block costs but {len(states)} block states: give one state per block")
    ranks = [_STATE_ORDER[state] for state in states]
    if ranks != sorted(ranks):
        names = ", ".join(state.value for state in states)
        raise ValueError(
            f"block states must be cached..., then frozen..., then active... from the bottom up; got [{names}]"
        )


def as_trained(costs: Sequence[BlockCost], states: Sequence[BlockState]) -> list[BlockCost]:
    """``costs`` as a step in ``states`` runs them: the lowest active block computes no gradient for its input
    (nothing below it trains, so its input does not require one), so its backward drops ``input_grad_share``."""
    costs = list(costs)
    lowest = next((i for i, state in enumerate(states) if state is BlockState.ACTIVE), None)
    if lowest is not None and costs[lowest].input_grad_share:
        cost = costs[lowest]
        kept = 1.0 - cost.input_grad_share
        costs[lowest] = replace(cost, backward_s=cost.backward_s * kept, backward_fixed_s=cost.backward_fixed_s * kept,
                                input_grad_share=0.0)
    return costs


def block_seconds(cost: BlockCost, state: BlockState) -> tuple[float, float]:
    """Seconds ``cost`` takes in ``state`` per sample, and what it adds to every micro-batch whatever its size."""
    if state is BlockState.ACTIVE:
        return cost.forward_s + cost.backward_s, cost.forward_fixed_s + cost.backward_fixed_s
    if state is BlockState.FROZEN:
        return cost.frozen_forward
    return 0.0, 0.0


def block_forward_seconds(cost: BlockCost, state: BlockState, samples: int) -> float:
    """The forward of one call on ``samples`` samples in ``state`` (a cached block does not run)."""
    if state is BlockState.ACTIVE:
        return cost.seconds(samples)[0]
    if state is BlockState.FROZEN:
        return cost.frozen_seconds(samples)
    return 0.0


def block_memory(cost: BlockCost, state: BlockState, *, micro_batch_size: int,
                 optimizer_state_factor: int = ADAMW_STATE_FACTOR, in_flight_micro_batches: int = 1) -> int:
    """Bytes a block occupies on its device while training.

    Active: parameters, their gradients, optimizer state, and the activations of every micro-batch
    whose backward has not run yet (GPipe keeps all M in flight, 1F1B at most K).
    """
    if state is BlockState.ACTIVE:
        weights = cost.param_bytes * (2 + optimizer_state_factor)
        return weights + cost.activation_bytes * micro_batch_size * in_flight_micro_batches
    if state is BlockState.FROZEN:
        return cost.param_bytes
    return 0


def transfer_time(num_bytes: float, link: Link) -> float:
    """One message over ``link``."""
    return num_bytes / link.bandwidth_bytes_per_s + link.latency_s


def stage_timing(
    costs: Sequence[BlockCost], states: Sequence[BlockState], start: int, end: int, link: Link
) -> StageTiming:
    """Compute of blocks ``start..end-1`` (their per-sample and fixed parts, :func:`as_trained`) plus the messages on
    the stage's two boundaries.

    An input boundary exists unless the stage starts the model or its input comes from the cache;
    an output boundary exists unless the stage ends the model. Each boundary carries the activation
    forward and, when some block below it trains, its gradient backward.
    """
    if not 0 <= start < end <= len(costs):
        raise ValueError(f"stage bounds must satisfy 0 <= start < end <= {len(costs)}, got ({start}, {end})")
    costs = as_trained(costs, states)
    terms = [block_seconds(costs[i], states[i]) for i in range(start, end)]
    per_sample = sum(each for each, _ in terms)
    fixed = sum(each for _, each in terms)
    boundaries = []
    if start > 0 and states[start - 1] is not BlockState.CACHED:
        boundaries.append(start)
    if end < len(costs):
        boundaries.append(end)
    for boundary in boundaries:
        messages = 2 if states[boundary - 1] is BlockState.ACTIVE else 1
        per_sample += messages * costs[boundary - 1].output_bytes / link.bandwidth_bytes_per_s
        fixed += messages * link.latency_s
    return StageTiming(per_sample, fixed)


def stage_time(
    costs: Sequence[BlockCost],
    states: Sequence[BlockState],
    start: int,
    end: int,
    *,
    micro_batch_size: int,
    link: Link,
) -> float:
    """Seconds stage ``[start, end)`` spends on one micro-batch, forward and backward."""
    return stage_timing(costs, states, start, end, link).at(micro_batch_size)


def stage_memory(costs: Sequence[BlockCost], states: Sequence[BlockState], start: int, end: int, *,
                 micro_batch_size: int, optimizer_state_factor: int = ADAMW_STATE_FACTOR,
                 in_flight_micro_batches: int = 1) -> int:
    """The blocks' memory (:func:`block_memory`) plus the largest activations one recomputed block
    rebuilds for one micro-batch in its backward (they are freed before the next block's backward)."""
    rebuilt = max((costs[i].recompute_bytes for i in range(start, end) if states[i] is BlockState.ACTIVE), default=0)
    return rebuilt * micro_batch_size + sum(
        block_memory(
            costs[i],
            states[i],
            micro_batch_size=micro_batch_size,
            optimizer_state_factor=optimizer_state_factor,
            in_flight_micro_batches=in_flight_micro_batches,
        )
        for i in range(start, end)
    )


def recomputed(cost: BlockCost, input_bytes: int) -> BlockCost:
    """``cost`` with activation checkpointing: backward first re-runs the forward, and between forward
    and backward only the block's input (``input_bytes`` per sample, the previous block's output) is kept.
    The input gradient's share shrinks to the same seconds (per sample) of the longer backward.
    """
    if cost.recompute_bytes:
        return cost
    backward_s = cost.backward_s + cost.forward_s
    return replace(
        cost,
        backward_s=backward_s,
        backward_fixed_s=cost.backward_fixed_s + cost.forward_fixed_s,
        activation_bytes=input_bytes,
        recompute_bytes=cost.activation_bytes,
        input_grad_share=cost.input_grad_share * cost.backward_s / backward_s if backward_s > 0 else 0.0,
    )


def costs_from_work(
    work: Sequence[BlockWork],
    *,
    flops_per_second: float,
    memory_bytes_per_second: float = math.inf,
    precision: Precision = Precision.FP32,
) -> list[BlockCost]:
    """Per-sample costs of ``work`` on a device: FLOPs at ``flops_per_second`` (the sustained rate of
    ``precision``'s arithmetic) plus the memory-bound traffic at ``memory_bytes_per_second``; backward
    does :data:`BACKWARD_TO_FORWARD_FLOPS` times the forward's work.
    """
    if not flops_per_second > 0 or not memory_bytes_per_second > 0:
        raise ValueError(
            f"flops_per_second and memory_bytes_per_second must be > 0, got {flops_per_second} and "
            f"{memory_bytes_per_second}"
        )
    element = precision.activation_bytes
    costs = []
    for block in work:
        forward_s = block.forward_flops / flops_per_second + block.memory_elements * element / memory_bytes_per_second
        costs.append(BlockCost(
            forward_s=forward_s,
            backward_s=forward_s * BACKWARD_TO_FORWARD_FLOPS,
            output_bytes=block.output_bytes(precision),
            param_bytes=block.params * FLOAT_BYTES,
            activation_bytes=block.saved_elements * element,
        ))
    return costs


def analytic_work(
    *,
    num_layers: int,
    hidden_size: int,
    seq_len: int,
    num_heads: int,
    vocab_size: int,
    num_classes: int,
    mlp_ratio: float = 4.0,
    embedding_is_lookup: bool = True,
    carries_attention_mask: bool = True,
) -> list[BlockWork]:
    """Work per sample of ``embeddings, layer_0..layer_{L-1}, head`` of a standard encoder.

    ``vocab_size`` is the embedding's input width: the token vocabulary of a text model
    (``embedding_is_lookup=True``: a table lookup, nearly free) or the flattened patch size of a ViT
    (``False``: a matmul). ``num_classes`` is the head's output width.
    """
    if min(num_layers, hidden_size, seq_len, num_heads, vocab_size, num_classes) <= 0 or mlp_ratio <= 0:
        raise ValueError("analytic_work needs positive layer dimensions")
    d, t = hidden_size, seq_len
    mlp_width = math.ceil(mlp_ratio * d)
    mask_bytes = t * MASK_ELEMENT_BYTES if carries_attention_mask else 0
    elementwise_flops = ELEMENTWISE_FLOPS_PER_FEATURE * t * d

    def block(forward_flops: float, params: int, saved: int, out_elements: int, out_extra: int) -> BlockWork:
        return BlockWork(
            forward_flops=forward_flops,
            memory_elements=MEMORY_PASSES_PER_SAVED_ELEMENT * saved,
            params=params,
            saved_elements=saved,
            output_elements=out_elements,
            output_extra_bytes=out_extra,
        )

    norm_params = PARAMS_PER_LAYER_NORM_FEATURE * d
    embedding_params = (vocab_size + t) * d + d + norm_params
    embedding_flops = elementwise_flops
    if not embedding_is_lookup:
        embedding_flops += FLOPS_PER_MULTIPLY_ADD * t * vocab_size * d
    embeddings = block(embedding_flops, embedding_params, 2 * t * d, t * d, mask_bytes)

    layer_params = (
        ATTENTION_PROJECTIONS * (d * d + d)
        + d * mlp_width + mlp_width + mlp_width * d + d
        + LAYER_NORMS_PER_LAYER * norm_params
    )
    layer_matmul_flops = FLOPS_PER_MULTIPLY_ADD * t * (ATTENTION_PROJECTIONS * d * d + MLP_MATRICES * d * mlp_width)
    attention_flops = 2 * FLOPS_PER_MULTIPLY_ADD * t * t * d
    layer_saved = (
        SAVED_HIDDEN_TENSORS_PER_LAYER * t * d
        + SAVED_MLP_TENSORS_PER_LAYER * t * mlp_width
        + SAVED_ATTENTION_MAPS_PER_HEAD * num_heads * t * t
    )
    layer = block(layer_matmul_flops + attention_flops + elementwise_flops, layer_params, layer_saved, t * d,
                  mask_bytes)

    head_flops = elementwise_flops + FLOPS_PER_MULTIPLY_ADD * d * num_classes
    head = block(head_flops, d * num_classes + num_classes, t * d, num_classes, 0)
    return [embeddings, *([layer] * num_layers), head]


def analytic_costs(*, flops_per_second: float, **dimensions: float | bool) -> list[BlockCost]:
    """Estimated fp32 costs of ``embeddings, layer_0..layer_{L-1}, head`` when profiling is off
    (:func:`analytic_work` of the model's ``dimensions``, its keyword arguments, at ``flops_per_second``; memory
    traffic free).

    Only the ratios between blocks matter to the partitioner, the absolute speed only to the
    micro-batch choice.
    """
    if flops_per_second <= 0:
        raise ValueError(f"analytic_costs needs flops_per_second > 0, got {flops_per_second}")
    return costs_from_work(analytic_work(**dimensions), flops_per_second=flops_per_second)  # type: ignore[arg-type]
