"""The control vector: one tensor, one all-reduce, every field back where it was; who contributes what."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from pipetransformer.config import PipeConfig, TrainConfig
from pipetransformer.freeze.apply import PreviousGradients, PreviousWeights, block_grad_sq_norms
from pipetransformer.pipe.planner import LayoutPlan, plan_layout
from pipetransformer.train.control import (DEVICE_FIELDS, HOST_FIELDS, ControlLedger, ControlVector,
                                           TrainingDivergedError, gather_control)
from pipetransformer.train.elastic import UNIFORM_COST, Placement
from pipetransformer.train.optimizer import HeldOptimizer
from tiny import LAYERS, PIXELS, tiny_dataset, tiny_model

LOSS_SUM = 0.75


def test_control_vector_sums_fields_and_reads_dot_products_only_where_valid() -> None:
    control = ControlVector.zeros(3)
    control.layer_grad_sq[:] = torch.tensor([4.0, 9.0, 16.0])
    control.layer_grad_dots[:] = torch.tensor([1.5, 0.0, -2.0])
    control.layer_dot_valid[:] = torch.tensor([1.0, 0.0, 1.0])
    control.loss[0] = 0.25
    reduced = control.all_reduce()  # one process: the sum is the vector itself
    assert reduced.layer_grad_norms() == [2.0, 3.0, 4.0]
    assert reduced.layer_dots() == [1.5, None, -2.0]
    assert float(reduced.loss) == 0.25 and float(reduced.stop_requests) == 0.0


def test_every_field_comes_back_from_the_packed_tensor_where_it_was() -> None:
    control = ControlVector.zeros(LAYERS)
    names = [*DEVICE_FIELDS, *HOST_FIELDS]
    for offset, name in enumerate(names):
        tensor = getattr(control, name)
        tensor[:] = torch.arange(tensor.numel(), dtype=torch.float64) + 10 * offset
    assert control.packed.numel() == ControlVector.width(LAYERS) == sum(getattr(control, n).numel() for n in names)
    reduced = control.all_reduce()
    for name in names:
        assert torch.equal(getattr(reduced, name), getattr(control, name)), name
    assert reduced.total_grad_norm() == math.sqrt(float(control.total_grad_sq))
    assert reduced.stop_requested


def _plan(world_size: int) -> LayoutPlan:
    """One stage over ``world_size`` replicas (no pipeline)."""
    return plan_layout(PipeConfig(), [UNIFORM_COST] * (LAYERS + 2), world_size, elastic=False, batch_size=8,
                       frozen_blocks=0, cached_blocks=0)


def test_replica_zero_brings_the_gradients_the_last_stage_the_loss_and_idle_ranks_only_a_stop() -> None:
    model = tiny_model()
    batch = tiny_dataset().get_batch(list(range(8)))
    nn.functional.cross_entropy(model(*batch.inputs), batch.labels).backward()
    expected = block_grad_sq_norms(model)
    loss_sum = torch.tensor(LOSS_SUM, dtype=torch.float64)
    first = gather_control(model, Placement.of(_plan(2), 0), loss_sum, stop=False, previous_grads=None)
    assert torch.equal(first.layer_grad_sq, expected[1:-1]) and float(first.total_grad_sq) == float(expected.sum())
    assert float(first.loss) == LOSS_SUM and not first.stop_requested
    second = gather_control(model, Placement.of(_plan(2), 1), loss_sum, stop=True, previous_grads=None)
    assert not second.layer_grad_sq.any() and float(second.total_grad_sq) == 0.0, "replica 1 counted twice"
    assert float(second.loss) == LOSS_SUM and second.stop_requested
    idle = gather_control(model, Placement.of(_plan(1), 1), loss_sum, stop=True, previous_grads=None)
    assert float(idle.loss) == 0.0 and not idle.layer_grad_sq.any() and idle.stop_requested


def test_a_non_finite_step_is_refused_naming_the_first_bad_layer() -> None:
    control = ControlVector.zeros(LAYERS)
    control.layer_grad_sq[1] = math.nan
    control.total_grad_sq[0] = math.nan
    with pytest.raises(TrainingDivergedError, match=r"at step 7, first in layer_1; nothing after step 6 was saved"):
        control.check_finite(7, Path("checkpoints"))
    with pytest.raises(TrainingDivergedError, match=r"at step 7, first in layer_1 \(read at step 10\)"):
        control.check_finite(7, Path("checkpoints"), read_at=10)
    ControlVector.zeros(LAYERS).check_finite(7, Path("checkpoints"))  # finite: nothing happens


def test_the_ledger_reads_every_pending_step_in_order_in_one_copy_and_empties() -> None:
    ledger = ControlLedger()
    assert ledger.read() == []
    for step in (4, 5, 6):
        control = ControlVector.zeros(LAYERS)
        control.loss[0] = step / 10
        ledger.append(step, control)
    assert len(ledger) == 3
    read = ledger.read()
    assert [step for step, _ in read] == [4, 5, 6] and [float(c.loss) for _, c in read] == [0.4, 0.5, 0.6]
    assert len(ledger) == 0 and ledger.read() == []


def test_a_steps_control_path_never_reads_the_device_on_the_host() -> None:
    """Statistics, control vector, clip, update and ledger on the meta device, whose values do not exist: any read on
    the host (``.item()``, ``float(t)``, ``.tolist()``, ``.cpu()``) raises. Only the ledger's read copies, once."""
    meta = torch.device("meta")
    model = tiny_model().to(meta)
    optimizer = HeldOptimizer(model, dataclasses.replace(TrainConfig(), grad_clip=1.0))
    optimizer.rebuild((0, len(model)), {})
    previous_grads, previous_weights = PreviousGradients(), PreviousWeights()
    ledger = ControlLedger()
    for step in (1, 2):  # the second has every statistic valid: the dot products and descents are computed
        inputs = torch.randn(8, *PIXELS, device=meta)
        loss = nn.functional.cross_entropy(model(inputs), torch.zeros(8, dtype=torch.long, device=meta))
        loss.backward()
        control = gather_control(model, Placement.of(_plan(1), 0), loss.detach().double(), stop=False,
                                 previous_grads=previous_grads, previous_weights=previous_weights)
        optimizer.step(1e-3, control.total_grad_sq.sqrt())
        ledger.append(step, control)
    assert control.packed.device == meta and len(ledger) == 2
    with pytest.raises(NotImplementedError, match="meta"):  # the one copy: there is nothing to copy on meta
        ledger.read()
