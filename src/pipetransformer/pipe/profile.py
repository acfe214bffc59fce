"""Measure every block's :class:`~pipetransformer.pipe.cost.BlockCost` on the device it runs on.

Each block is timed alone on the real activation its predecessor produces, so the partitioner sees
what this machine actually does (embeddings and heads are often far from a layer's cost). It is timed on
two batch sizes, so its time splits into a part per sample and a part per call: a micro-batch of 4 is not
half the time of one of 8 (MiniLM's embeddings, on one CPU thread: ~20 ms a call at 2 samples and at 16,
the dense gradient of the token table). Its forward is timed again as the trainer runs a frozen block, in eval
mode without an autograd graph: a MiniLM layer's took ~20% less than its training forward; and its backward without
the gradient of its input, as the lowest trainable block runs it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import fields
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from pipetransformer.dp.sync import vocabulary_tables
from pipetransformer.models.blocks import Activation, BlockSequence, as_activation, run_blocks
from pipetransformer.pipe.cost import BlockCost, BlockWork, analytic_work, costs_from_work

__all__ = ["ANALYTIC_FLOPS_PER_SECOND", "PROFILE_BATCH", "PROFILE_REPEATS", "PROFILE_WARMUP", "SMALL_BATCH_DIVISOR",
           "analytic_block_work", "broadcast_costs", "estimate_block_costs", "per_sample_and_fixed",
           "profile_blocks"]

PROFILE_BATCH = 8
"""Samples of the example batch blocks are profiled on (and on a quarter of it): enough to time, cheap to run."""

SMALL_BATCH_DIVISOR = 4
"""Blocks are also timed on 1/4 of the example batch; the line through the two timings gives a block's time per
sample (its slope) and per call (its intercept). A quarter keeps the two sizes far apart and the extra runs cheap."""

PROFILE_WARMUP, PROFILE_REPEATS = 1, 3
"""Untimed and timed runs (forward + backward) of each block; costs are the timed runs' medians."""

_T = TypeVar("_T")


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _tensor_bytes(tensors: Activation) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _with_input_grads(activation: Activation, needs_input_grad: bool) -> Activation:
    """Fresh leaves so backward stops at the block's input, computing its gradient as a pipeline stage must;
    the model's own inputs (block 0) never need one, so training does not compute it and neither do we."""
    return tuple(t.detach().requires_grad_(needs_input_grad and t.is_floating_point()) for t in activation)


class _SavedBytes:
    """Bytes of the distinct storages autograd keeps for backward, parameters excluded (they are counted apart)."""

    def __init__(self, block: nn.Module) -> None:
        self._param_storages = {p.untyped_storage().data_ptr() for p in block.parameters()}
        self._saved: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._param_storages:
            self._saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self._saved.values())


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _timed(run: Callable[[], _T], device: torch.device) -> tuple[_T, float]:
    _synchronize(device)
    start = time.perf_counter()
    result = run()
    _synchronize(device)
    return result, time.perf_counter() - start


def _time_block(
    block: nn.Module, activation: Activation, warmup: int, repeats: int, needs_input_grad: bool,
    compute_dtype: torch.dtype | None, saved: _SavedBytes | None,
) -> tuple[float, float, Activation]:
    """Median forward and backward seconds of ``block`` on ``activation``, and its output; the first run also
    records the tensors autograd saves into ``saved`` (it is a warm-up run unless ``warmup`` is 0)."""
    device = activation[0].device
    forward_times, backward_times = [], []
    output: Activation = ()
    for run in range(warmup + repeats):
        inputs = _with_input_grads(activation, needs_input_grad)
        record = saved is not None and run == 0
        hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, _unpack) if record else nullcontext()
        with hooks:
            output, forward_s = _timed(lambda: run_blocks([block], inputs, compute_dtype=compute_dtype), device)
        outputs = [t for t in output if t.requires_grad]
        _, backward_s = _timed(lambda: torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs]), device)
        forward_times.append(forward_s)
        backward_times.append(backward_s)
    return statistics.median(forward_times[warmup:]), statistics.median(backward_times[warmup:]), output


def _time_frozen_forward(block: nn.Module, activation: Activation, warmup: int, repeats: int,
                         compute_dtype: torch.dtype | None) -> float:
    """Median forward seconds of ``block`` as the trainer runs it frozen: eval mode, no autograd graph."""
    device = activation[0].device
    was_training = block.training
    block.train(False)
    try:
        with torch.no_grad():
            times = [_timed(lambda: run_blocks([block], activation, compute_dtype=compute_dtype), device)[1]
                     for _ in range(warmup + repeats)]
    finally:
        block.train(was_training)
    return statistics.median(times[warmup:])


def _input_grad_share(block: nn.Module, activation: Activation, backward_s: float, warmup: int, repeats: int,
                      compute_dtype: torch.dtype | None) -> float:
    """Share of ``backward_s`` (timed with the input's gradient) that computing that gradient takes: the block timed
    again as the lowest trainable block runs it, without. Within [0, 1]: timing noise never makes it negative; a
    block without parameters computes nothing else."""
    if not any(p.requires_grad for p in block.parameters()):
        return 1.0
    _, without_s, _ = _time_block(block, activation, warmup, repeats, False, compute_dtype, None)
    return min(1.0, max(0.0, 1.0 - without_s / backward_s)) if backward_s > 0 else 0.0


def _touched_row_bytes(block: nn.Module, activation: Activation, batch_size: int,
                       compute_dtype: torch.dtype | None) -> tuple[int, int]:
    """(bytes of the block's vocabulary tables, bytes of the rows one sample's ids can touch): what replicas
    summing tables by touched rows (``dp.touched_rows_only``) all-reduce, read off one forward's ids."""
    modules = vocabulary_tables(block.modules())
    if not modules:
        return 0, 0
    ids: dict[int, int] = {}

    def count_ids(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        ids[id(module)] = ids.get(id(module), 0) + args[0].numel()

    hooks = [module.register_forward_pre_hook(count_ids) for module in modules]
    try:
        with torch.no_grad():
            run_blocks([block], activation, compute_dtype=compute_dtype)
    finally:
        for hook in hooks:
            hook.remove()
    per_sample = sum(-(-ids.get(id(m), 0) // batch_size) * m.embedding_dim * m.weight.element_size() for m in modules)
    return sum(m.weight.numel() * m.weight.element_size() for m in modules), per_sample


def per_sample_and_fixed(small_s: float, large_s: float, small: int, large: int) -> tuple[float, float]:
    """(seconds per sample, seconds per call) of the line through ``small_s`` on ``small`` samples and ``large_s``
    on ``large``. The slope is kept within [0, large_s / large], so both parts are >= 0 and the line still gives
    ``large_s`` at ``large``: timing noise never makes a block free, nor dearer than measured at the profiled size.
    """
    if large < 1 or not 0 < small < large:
        raise ValueError(f"need 0 < small < large, got small={small}, large={large}")
    per_sample = min(max(0.0, (large_s - small_s) / (large - small)), large_s / large)
    return per_sample, large_s - per_sample * large


def _profile_block(
    block: nn.Module, activation: Activation, batch_size: int, warmup: int, repeats: int, needs_input_grad: bool,
    compute_dtype: torch.dtype | None,
) -> tuple[BlockCost, Activation]:
    """The block timed on the whole example batch and on its first ``batch_size // SMALL_BATCH_DIVISOR`` samples
    (a batch too small for two sizes gets costs per sample only)."""
    saved = _SavedBytes(block)
    forward_s, backward_s, output = _time_block(block, activation, warmup, repeats, needs_input_grad, compute_dtype,
                                                saved)
    frozen_s = _time_frozen_forward(block, activation, warmup, repeats, compute_dtype)
    input_grad_share = (_input_grad_share(block, activation, backward_s, warmup, repeats, compute_dtype)
                        if needs_input_grad else 0.0)
    table_bytes, touched_per_sample = _touched_row_bytes(block, activation, batch_size, compute_dtype)
    small = batch_size // SMALL_BATCH_DIVISOR
    if small >= 1:
        head = tuple(t[:small] for t in activation)
        small_forward_s, small_backward_s, _ = _time_block(block, head, warmup, repeats, needs_input_grad,
                                                           compute_dtype, None)
        small_frozen_s = _time_frozen_forward(block, head, warmup, repeats, compute_dtype)
        forward_per_sample, forward_fixed = per_sample_and_fixed(small_forward_s, forward_s, small, batch_size)
        backward_per_sample, backward_fixed = per_sample_and_fixed(small_backward_s, backward_s, small, batch_size)
        frozen_per_sample, frozen_fixed = per_sample_and_fixed(small_frozen_s, frozen_s, small, batch_size)
    else:
        forward_per_sample, forward_fixed = forward_s / batch_size, 0.0
        backward_per_sample, backward_fixed = backward_s / batch_size, 0.0
        frozen_per_sample, frozen_fixed = frozen_s / batch_size, 0.0
    cost = BlockCost(
        forward_s=forward_per_sample,
        backward_s=backward_per_sample,
        output_bytes=_tensor_bytes(output) // batch_size,
        param_bytes=sum(p.numel() * p.element_size() for p in block.parameters()),
        activation_bytes=saved.total // batch_size,
        forward_fixed_s=forward_fixed,
        backward_fixed_s=backward_fixed,
        frozen_forward_s=frozen_per_sample,
        frozen_forward_fixed_s=frozen_fixed,
        row_summed_bytes=table_bytes,
        touched_row_bytes_per_sample=touched_per_sample,
        input_grad_share=input_grad_share,
    )
    return cost, tuple(t.detach() for t in output)


@contextmanager
def _training_everything(model: nn.Module) -> Iterator[None]:
    """Train mode and trainable parameters while profiling (backward must include weight gradients);
    the model's own modes, flags and gradients are restored afterwards."""
    was_training = model.training
    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    grads = [p.grad for p in params]
    model.train()
    for p in params:
        p.requires_grad_(True)
    try:
        yield
    finally:
        model.train(was_training)
        for p, flag, grad in zip(params, flags, grads, strict=True):
            p.requires_grad_(flag)
            p.grad = grad


def profile_blocks(
    model: BlockSequence, example_inputs: tuple[torch.Tensor, ...], *, warmup: int = PROFILE_WARMUP,
    repeats: int = PROFILE_REPEATS
) -> list[BlockCost]:
    """Per-sample and per-call forward/backward seconds (from medians), the same of the forward frozen, output,
    parameter and saved-activation bytes of each block, in the model's compute dtype.

    ``example_inputs`` is one batch of model inputs (batch dimension first), on the model's device.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    batch_size = example_inputs[0].shape[0]
    costs = []
    activation: Activation = tuple(example_inputs)
    with _training_everything(model):
        for index, block in enumerate(model.blocks):
            cost, activation = _profile_block(block, activation, batch_size, warmup, repeats,
                                              needs_input_grad=index > 0, compute_dtype=model.compute_dtype)
            costs.append(cost)
    return costs


ANALYTIC_FLOPS_PER_SECOND = 2e10
"""Assumed device speed for the analytical cost model; only the ratios between blocks matter to the partition."""


def analytic_block_work(model: BlockSequence, example_inputs: tuple[torch.Tensor, ...], *,
                        num_classes: int) -> list[BlockWork]:
    """Per-block work of ``model`` from its layer dimensions (read off one embeddings forward)."""
    text = model.task == "text"
    with torch.no_grad():
        hidden = as_activation(model.blocks[0](*example_inputs))[0]
    seq_len, dim = hidden.shape[1], hidden.shape[2]
    heads = getattr(getattr(model.blocks[1], "config", None), "num_attention_heads", None) or 1
    width = example_inputs[0].shape[1] if text else example_inputs[0][0].numel() // seq_len
    return analytic_work(num_layers=model.num_layers, hidden_size=dim, seq_len=seq_len, num_heads=heads,
                         vocab_size=max(1, width), num_classes=num_classes, embedding_is_lookup=text,
                         carries_attention_mask=text)


def estimate_block_costs(model: BlockSequence, example_inputs: tuple[torch.Tensor, ...], *, num_classes: int,
                         measure: bool) -> list[BlockCost]:
    """Per-block costs: measured by :func:`profile_blocks`, or (``measure=False``) from the layer dimensions."""
    if measure:
        return profile_blocks(model, example_inputs)
    work = analytic_block_work(model, example_inputs, num_classes=num_classes)
    return costs_from_work(work, flops_per_second=ANALYTIC_FLOPS_PER_SECOND)


def broadcast_costs(costs: list[BlockCost] | None, num_blocks: int) -> list[BlockCost]:
    """Rank 0's ``costs`` (the other ranks pass None) on every rank of the default group, every field in one
    broadcast of a CPU tensor (the default group carries gloo for those), so every rank plans from the same numbers."""
    names = [field.name for field in fields(BlockCost)]
    counts = {field.name for field in fields(BlockCost) if field.type == "int"}  # byte counts: exact in a float64
    table = torch.zeros(num_blocks, len(names), dtype=torch.float64)
    if costs is not None:
        table = torch.tensor([[math.nan if getattr(cost, name) is None else float(getattr(cost, name))
                               for name in names] for cost in costs], dtype=torch.float64)
    dist.broadcast(table, src=0)

    def value(name: str, number: float) -> float | int | None:  # NaN stands for a field left None
        return None if math.isnan(number) else int(number) if name in counts else number

    return [BlockCost(**{name: value(name, number) for name, number in zip(names, row, strict=True)})  # type: ignore[arg-type]
            for row in table.tolist()]
