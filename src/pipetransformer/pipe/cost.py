"""Cost model of blocks and pipeline stages: what AutoPipe balances.

A block is measured once per *sample* (:class:`BlockCost`); its cost in a stage then depends on its
state (trainable, frozen, or frozen with its output served from the cache) and on the micro-batch
size. Everything here is plain arithmetic so the partitioner can be tested exhaustively without torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "ADAMW_STATE_FACTOR",
    "BlockCost",
    "BlockState",
    "Link",
    "StageTiming",
    "analytic_costs",
    "block_memory",
    "block_seconds_per_sample",
    "stage_memory",
    "stage_time",
    "stage_timing",
    "transfer_time",
    "validate_states",
]

ADAMW_STATE_FACTOR = 2
"""AdamW keeps two tensors (first and second moments) the size of the parameters."""

FLOAT_BYTES = 4
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


class BlockState(Enum):
    """How a block takes part in training; freezing and caching both grow from the bottom up."""

    CACHED = "cached"
    FROZEN = "frozen"
    ACTIVE = "active"


_STATE_ORDER = {BlockState.CACHED: 0, BlockState.FROZEN: 1, BlockState.ACTIVE: 2}


@dataclass(frozen=True)
class BlockCost:
    """One block's measured or estimated cost, per sample (see :func:`analytic_costs`)."""

    forward_s: float
    backward_s: float
    output_bytes: int
    param_bytes: int
    activation_bytes: int


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


def block_seconds_per_sample(cost: BlockCost, state: BlockState) -> float:
    if state is BlockState.ACTIVE:
        return cost.forward_s + cost.backward_s
    if state is BlockState.FROZEN:
        return cost.forward_s
    return 0.0


def block_memory(
    cost: BlockCost,
    state: BlockState,
    *,
    micro_batch_size: int,
    optimizer_state_factor: int = ADAMW_STATE_FACTOR,
    in_flight_micro_batches: int = 1,
) -> int:
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
    """Compute of blocks ``start..end-1`` plus the messages on the stage's two boundaries.

    An input boundary exists unless the stage starts the model or its input comes from the cache;
    an output boundary exists unless the stage ends the model. Each boundary carries the activation
    forward and, when some block below it trains, its gradient backward.
    """
    if not 0 <= start < end <= len(costs):
        raise ValueError(f"stage bounds must satisfy 0 <= start < end <= {len(costs)}, got ({start}, {end})")
    per_sample = sum(block_seconds_per_sample(costs[i], states[i]) for i in range(start, end))
    fixed = 0.0
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


def stage_memory(
    costs: Sequence[BlockCost],
    states: Sequence[BlockState],
    start: int,
    end: int,
    *,
    micro_batch_size: int,
    optimizer_state_factor: int = ADAMW_STATE_FACTOR,
    in_flight_micro_batches: int = 1,
) -> int:
    return sum(
        block_memory(
            costs[i],
            states[i],
            micro_batch_size=micro_batch_size,
            optimizer_state_factor=optimizer_state_factor,
            in_flight_micro_batches=in_flight_micro_batches,
        )
        for i in range(start, end)
    )


def analytic_costs(
    *,
    num_layers: int,
    hidden_size: int,
    seq_len: int,
    num_heads: int,
    vocab_size: int,
    num_classes: int,
    flops_per_second: float,
    mlp_ratio: float = 4.0,
    embedding_is_lookup: bool = True,
    carries_attention_mask: bool = True,
) -> list[BlockCost]:
    """Estimated costs of ``embeddings, layer_0..layer_{L-1}, head`` when profiling is off.

    ``vocab_size`` is the embedding's input width: the token vocabulary of a text model
    (``embedding_is_lookup=True``: a table lookup, nearly free) or the flattened patch size of a ViT
    (``False``: a matmul). Times assume every FLOP runs at ``flops_per_second``: only the ratios
    between blocks matter to the partitioner, the absolute value only to the micro-batch choice.
    """
    if min(num_layers, hidden_size, seq_len, num_heads, vocab_size, num_classes) <= 0 or flops_per_second <= 0:
        raise ValueError("analytic_costs needs positive layer dimensions and flops_per_second")
    d, t = hidden_size, seq_len
    mlp_width = math.ceil(mlp_ratio * d)
    hidden_bytes = t * d * FLOAT_BYTES
    output_bytes = hidden_bytes + (t * MASK_ELEMENT_BYTES if carries_attention_mask else 0)
    elementwise_flops = ELEMENTWISE_FLOPS_PER_FEATURE * t * d

    def block(forward_flops: float, params: int, saved_elements: int, out_bytes: int) -> BlockCost:
        forward_s = forward_flops / flops_per_second
        return BlockCost(
            forward_s=forward_s,
            backward_s=forward_s * BACKWARD_TO_FORWARD_FLOPS,
            output_bytes=out_bytes,
            param_bytes=params * FLOAT_BYTES,
            activation_bytes=saved_elements * FLOAT_BYTES,
        )

    norm_params = PARAMS_PER_LAYER_NORM_FEATURE * d
    embedding_params = (vocab_size + t) * d + d + norm_params
    embedding_flops = elementwise_flops
    if not embedding_is_lookup:
        embedding_flops += FLOPS_PER_MULTIPLY_ADD * t * vocab_size * d
    embeddings = block(embedding_flops, embedding_params, 2 * t * d, output_bytes)

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
    layer = block(layer_matmul_flops + attention_flops + elementwise_flops, layer_params, layer_saved, output_bytes)

    head_flops = elementwise_flops + FLOPS_PER_MULTIPLY_ADD * d * num_classes
    head = block(head_flops, d * num_classes + num_classes, t * d, num_classes * FLOAT_BYTES)
    return [embeddings, *([layer] * num_layers), head]
