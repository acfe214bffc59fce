"""The freezer's per-block statistics split over a stage's replicas (``freeze.apply.replica_share``), on 2 real gloo
processes: each replica measures its share of the blocks, and the control vector's all-reduce gives every rank the
same descents, dot products and valid flags as one rank measuring every block."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from pipetransformer.config import PipeConfig
from pipetransformer.freeze.apply import PreviousGradients, PreviousWeights
from pipetransformer.pipe.planner import LayoutPlan, plan_layout
from pipetransformer.train.control import gather_control
from pipetransformer.train.elastic import UNIFORM_COST, Placement
from process_group import free_port, join, leave
from tiny import LAYERS, tiny_dataset, tiny_model

pytestmark = pytest.mark.slow

WORLD = 2
BATCH = 8
STEPS = 3  # the first has no previous step: nothing valid; the next two have every block valid
LR = 0.1
FIELDS = ("layer_grad_sq", "total_grad_sq", "layer_grad_dots", "layer_dot_valid", "layer_descents",
          "layer_descent_valid", "loss")


def _plan(replicas: int) -> LayoutPlan:
    return plan_layout(PipeConfig(), [UNIFORM_COST] * (LAYERS + 2), replicas, elastic=False, batch_size=BATCH,
                       frozen_blocks=0, cached_blocks=0)


def _worker(rank: int, port: int, out: str) -> None:
    """Both ranks hold the same model and gradients (each takes the whole batch, as replicas do after their sync) and
    gather two control vectors a step: split over the 2 replicas, and measured by rank 0 alone (rank 1 idle)."""
    join(rank, WORLD, port)
    model, dataset = tiny_model(), tiny_dataset()
    split, alone = Placement.of(_plan(WORLD), rank), Placement.of(_plan(1), rank)
    trackers = {name: (PreviousGradients(), PreviousWeights()) for name in ("split", "alone")}
    vectors: dict[str, list[dict[str, torch.Tensor]]] = {"split": [], "alone": []}
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        batch = dataset.get_batch(list(range(step * BATCH, (step + 1) * BATCH)))
        loss = nn.functional.cross_entropy(model(*batch.inputs), batch.labels)
        loss.backward()
        loss_sum = loss.detach().double()
        for name, placement in (("split", split), ("alone", alone)):
            grads, weights = trackers[name]
            control = gather_control(model, placement, loss_sum if rank == 0 else torch.zeros_like(loss_sum),
                                     stop=False, previous_grads=grads, previous_weights=weights)
            vectors[name].append({field: getattr(control, field).clone() for field in FIELDS})
        with torch.no_grad():
            for parameter in model.parameters():
                parameter -= LR * parameter.grad
    layout = trackers["split"][1]._layout
    torch.save({"vectors": vectors, "measured": [index for index, _ in layout.blocks] if layout else []},
               f"{out}/rank{rank}.pt")
    leave()


def test_each_replica_measures_its_share_and_the_sum_is_one_rank_measuring_every_block(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD)]
    # blocks 0..LAYERS (the embeddings and the layers; the head has no descent): every other one a replica
    assert [r["measured"] for r in ranks] == [list(range(0, LAYERS + 1, 2)), list(range(1, LAYERS + 1, 2))]
    for rank in ranks:
        for step, (split, alone) in enumerate(zip(rank["vectors"]["split"], rank["vectors"]["alone"], strict=True)):
            for field in FIELDS:
                assert torch.equal(split[field], alone[field]), f"step {step}: {field}"
        first, last = rank["vectors"]["split"][0], rank["vectors"]["split"][-1]
        assert not first["layer_descent_valid"].gt(0).any() and not first["layer_dot_valid"].gt(0).any()
        assert last["layer_descent_valid"].eq(1).all() and last["layer_dot_valid"].eq(1).all()
        assert last["layer_descents"].ne(0).all() and last["layer_grad_dots"].ne(0).all()
