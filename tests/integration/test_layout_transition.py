"""An ElasticLayout transition on 2 real gloo processes, without a Trainer: a 2-stage pipeline trains, two blocks
freeze, the layout becomes 1 stage x 2 replicas (every block and its optimizer state handed over), the replicas
train on; weights, optimizer state and losses equal one process doing the same steps."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from pipetransformer.config import DPConfig, PipeConfig, TrainConfig
from pipetransformer.freeze.apply import block_grad_sq_norms, freeze_blocks
from pipetransformer.metrics import StepTimer
from pipetransformer.models.blocks import BlockSequence
from pipetransformer.pipe.planner import LayoutPlan, plan_layout
from pipetransformer.train.control import gather_control
from pipetransformer.train.elastic import UNIFORM_COST, ElasticLayout
from pipetransformer.train.optimizer import HeldOptimizer
from pipetransformer.train.step import LocalStep, PipelineStep
from process_group import free_port, join, leave
from tiny import CPU, LAYERS, env, layout, tiny_dataset, tiny_model

pytestmark = pytest.mark.slow

WORLD = 2
BATCH = 8
STEPS_PER_LAYOUT = 2
FROZEN_BLOCKS = 2  # the embeddings and layer 0
SETTINGS = dataclasses.replace(TrainConfig(), lr=1e-2, grad_clip=0.5)  # small enough a clip to act
ROWS = 2 * STEPS_PER_LAYOUT * BATCH
RTOL, ATOL = 1e-5, 1e-7


def _plan(stages: int, frozen_blocks: int) -> LayoutPlan:
    return plan_layout(PipeConfig(enabled=True, stages=stages, micro_batches=2), [UNIFORM_COST] * (LAYERS + 2), WORLD,
                       elastic=True, batch_size=BATCH, frozen_blocks=frozen_blocks, cached_blocks=0)


def _batches() -> list[list[int]]:
    return [list(range(step * BATCH, (step + 1) * BATCH)) for step in range(2 * STEPS_PER_LAYOUT)]


def _step(elastic: ElasticLayout, optimizer: HeldOptimizer, model: BlockSequence, global_batch: list[int]) -> float:
    """What the trainer's step does, from the components alone."""
    placement, executor = elastic.placement, elastic.executor
    assert executor is not None
    loss_sum = torch.zeros((), dtype=torch.float64)
    batch = executor.load(placement.share(global_batch))
    if batch is not None:
        loss_sum += executor.forward_backward(batch, len(global_batch), StepTimer(CPU))
    executor.synchronize()
    control = gather_control(model, placement, loss_sum, stop=False, previous_grads=None)
    optimizer.step(SETTINGS.lr, control.total_grad_norm())
    return float(control.loss)


def _worker(rank: int, port: int, out: str) -> None:
    join(rank, WORLD, port)
    model = tiny_model()
    elastic = layout(model, tiny_dataset(ROWS), env(rank, WORLD), pipe=PipeConfig(enabled=True, stages=2),
                     dp=DPConfig(enabled=True), batch_size=BATCH)
    optimizer = HeldOptimizer(model, SETTINGS)
    assert elastic.transition(_plan(2, 0), optimizer) is None
    assert isinstance(elastic.executor, PipelineStep)
    batches = _batches()
    losses = [_step(elastic, optimizer, model, b) for b in batches[:STEPS_PER_LAYOUT]]
    freeze_blocks(model, range(FROZEN_BLOCKS), optimizer.optimizer)
    record = elastic.transition(_plan(1, FROZEN_BLOCKS), optimizer)
    assert isinstance(elastic.executor, LocalStep) and elastic.plan.layout.dp_width == WORLD
    losses += [_step(elastic, optimizer, model, b) for b in batches[STEPS_PER_LAYOUT:]]
    received = elastic.gather_to_main(optimizer)
    torch.save({"record": record, "losses": losses, "fingerprints": elastic.fingerprints(),
                "weights": {k: v.clone() for k, v in model.state_dict().items()},
                "optimizer": optimizer.state_dict(received)}, f"{out}/rank{rank}.pt")
    elastic.close()
    leave()


def _reference() -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The same four steps in one process: whole batches, no layout, the same freeze after two."""
    model, dataset = tiny_model(), tiny_dataset(ROWS)
    optimizer = HeldOptimizer(model, SETTINGS)
    optimizer.rebuild((0, len(model)), {})
    losses = []
    for step, indices in enumerate(_batches()):
        if step == STEPS_PER_LAYOUT:
            freeze_blocks(model, range(FROZEN_BLOCKS), optimizer.optimizer)
            optimizer.rebuild((0, len(model)), {})
        batch = dataset.get_batch(indices)
        loss = nn.functional.cross_entropy(model(*batch.inputs), batch.labels, reduction="sum") / len(indices)
        loss.backward()
        losses.append(float(loss.detach()))
        optimizer.step(SETTINGS.lr, float(block_grad_sq_norms(model).sum()) ** 0.5)
    return losses, model.state_dict(), optimizer.state_dict()


def test_a_pipeline_becomes_two_replicas_and_trains_on_as_one_process_does(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    first, second = (torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD))
    assert first["record"]["blocks_moved"] == LAYERS + 2, "each rank lacked the other stage's blocks"
    assert first["fingerprints"][0] == first["fingerprints"][1], "the replicas diverged"
    losses, weights, optimizer = _reference()
    assert first["losses"] == second["losses"] == pytest.approx(losses, rel=RTOL)
    for name, tensor in weights.items():
        torch.testing.assert_close(first["weights"][name], tensor, rtol=RTOL, atol=ATOL, msg=name)
    # After the transition both ranks are replicas of the one stage: each holds the whole optimizer state.
    assert first["optimizer"].keys() == second["optimizer"].keys() == optimizer.keys()
    for name, tensor in optimizer.items():
        torch.testing.assert_close(first["optimizer"][name], tensor, rtol=RTOL, atol=ATOL, msg=name)
        assert torch.equal(first["optimizer"][name], second["optimizer"][name]), f"replicas differ: {name}"
