"""What the freezer's statistics cost a step: a fixed number of ops per block, however many parameters it has, and
(on CUDA) no host sync. A per-parameter loop of small ops is cheap on two CPU cores and a kernel
launch each on a GPU, where steps take milliseconds."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pipetransformer.freeze.apply import PreviousWeights, block_grad_sq_norms
from pipetransformer.models.blocks import BlockSequence

WIDTH = 64
HOST_READ = "aten._local_scalar_dense"
"""The op behind ``.item()``, ``float(t)`` and ``bool(t)``: a copy of one value to the host, which waits for a GPU."""
LAYERS = 3
BATCH = 8


class ComputeOps(TorchDispatchMode):
    """Counts the aten ops that compute (views and aliases are metadata: no kernel), and apart from them the views
    (no kernel, but a dispatch each on the host)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.is_view:
            self.views += 1
        else:
            self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class Split(nn.Module):
    """A layer of ``parts`` linear maps side by side: the same width, ``2 * parts`` parameters."""

    def __init__(self, parts: int) -> None:
        super().__init__()
        self.parts = nn.ModuleList(nn.Linear(WIDTH, WIDTH // parts) for _ in range(parts))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.tanh(torch.cat([part(hidden) for part in self.parts], dim=-1)),)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(WIDTH, 2)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.out(hidden),)


def model_of(parts: int, layers: int = LAYERS) -> BlockSequence:
    torch.manual_seed(0)
    return BlockSequence(Split(parts), [Split(parts) for _ in range(layers)], Head(), task="image")


def a_step(model: BlockSequence, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(torch.randn(BATCH, WIDTH))[0].square().mean().backward()


def statistics_ops(parts: int, layers: int = LAYERS, *, norms: bool = True) -> ComputeOps:
    """The ops of one step's statistics (squared norms, unless not ``norms``, and descents of every block), after a
    first step set the previous samples."""
    model = model_of(parts, layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    history = PreviousWeights()
    blocks = range(len(model))
    a_step(model, optimizer)
    history.block_descents(model, blocks)
    optimizer.step()
    a_step(model, optimizer)
    with ComputeOps() as ops:
        if norms:
            block_grad_sq_norms(model, blocks)
        history.block_descents(model, blocks)
    return ops


def test_the_statistics_cost_a_fixed_number_of_ops_per_block_whatever_its_parameter_count() -> None:
    few, many = statistics_ops(parts=1).counts, statistics_ops(parts=8).counts  # 2 and 16 parameters a block
    assert few == many, f"ops that grow with the parameters: {(many - few) or (few - many)}"
    assert sum(few.values()) <= 6 * (LAYERS + 2) + 8, few  # a handful per block and per step, not per parameter
    assert HOST_READ not in few, "the statistics read a tensor's value on the host (.item()): a sync on a GPU"


def test_the_descents_cost_the_same_ops_whatever_the_number_of_blocks() -> None:
    """Every block's descent comes out of the same few fused ops (one concatenation of the weights' samples, one of
    the gradients', the products, one sum into the blocks): a dot product a block was five ops a block, and on a GPU
    five kernels."""
    shallow, deep = statistics_ops(1, LAYERS, norms=False).counts, statistics_ops(1, 2 * LAYERS, norms=False).counts
    assert shallow == deep, f"ops that grow with the blocks: {(deep - shallow) or (shallow - deep)}"
    assert sum(shallow.values()) <= 10, shallow


def test_the_descent_samples_each_parameter_with_one_view_of_its_weights_and_one_of_its_gradient() -> None:
    """The views the statistics add per parameter: one strided sample of the weights, one of the gradient (the
    norms read the gradients whole). Flattening then slicing took three a tensor."""
    extra_views = statistics_ops(parts=8).views - statistics_ops(parts=1).views
    extra_parameters = (LAYERS + 1) * (2 * 8 - 2)  # the embeddings and each layer: 16 parameters instead of 2
    assert extra_views <= 2 * extra_parameters, (extra_views, extra_parameters)


def count_syncs(step: Callable[[], None]) -> int:
    """CUDA host syncs ``step`` makes (``torch.cuda.set_sync_debug_mode`` warns at each)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(1 for warning in caught if "synchroniz" in str(warning.message))


@pytest.mark.cuda(devices=1)
def test_the_statistics_never_sync_the_host_on_cuda() -> None:
    """No host sync a step, whatever the model's size: the statistics stay on the device (their indices are made once
    per layout), in the step's control vector, which the trainer reads only where a decision needs it."""
    syncs = []
    for parts in (1, 8):
        model = model_of(parts).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        history = PreviousWeights()
        blocks = range(len(model))

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            model(torch.randn(BATCH, WIDTH, device="cuda"))[0].square().mean().backward()
            block_grad_sq_norms(model, blocks)
            history.block_descents(model, blocks)
            optimizer.step()

        step()
        step()  # the first with descents: their device index is made once, here
        syncs.append(count_syncs(step))
    assert syncs == [0, 0], syncs
