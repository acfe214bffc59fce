"""The plain-PyTorch AutoFreezer in an Accelerate loop with gradient accumulation, on 2 real gloo processes:
``accelerator.prepare`` wraps the model in DDP and the optimizer in ``AcceleratedOptimizer``; the freezer is called
on every micro-batch, as that optimizer's ``step`` is, and observes only the steps it takes; a freeze takes the
frozen gradients out of the all-reduce (seen from a comm hook) and out of the wrapped optimizer, every surviving
parameter keeping its state object."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from hf_text import rotten_tomatoes, tiny_classifier
from pipetransformer.config import FreezeConfig
from pipetransformer.integrations import AutoFreezer, find_layer_stack
from process_group import LOOPBACK, free_port, leave, record_buckets

pytestmark = pytest.mark.slow

WORLD = 2
ACCUMULATION = 2
MICRO_BATCH = 4
STEPS = 8  # optimizer steps: STEPS * ACCUMULATION micro-batches per rank
# A geometric window of 4 optimizer steps: 2 of the 6 layers (max_fraction 1/3) freeze at the end of the 4th.
WINDOW = 4
SETTINGS = FreezeConfig(policy="geometric", interval=WINDOW, interval_unit="steps", max_fraction=1 / 3)
EXPECTED_FROZEN = 2


def _accelerate_worker(rank: int, port: int, out: str) -> None:
    """Accelerate reads the process group's place from the environment, as torchrun sets it, and joins it itself."""
    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATION, cpu=True)
    data = rotten_tomatoes()
    model = tiny_classifier(data.input_ids.max().item() + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO_BATCH)
    ddp, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    buckets: list[int] = []
    ddp.register_comm_hook(buckets, record_buckets)
    freezer = AutoFreezer(ddp, optimizer, settings=SETTINGS, pretrained=False)
    full = sum(p.numel() for p in model.parameters())
    states_before: dict[str, int] = {}  # each parameter's optimizer state object, just before the freeze
    frozen_then: dict[str, torch.Tensor] = {}
    decisions, reduced, observed = [], [], []
    optimizer_steps = 0
    for _, (input_ids, attention_mask), labels in loader:  # items: (index, inputs, label)
        with accelerator.accumulate(ddp):
            accelerator.backward(ddp(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss)
            if accelerator.sync_gradients:
                reduced.append(sum(buckets))
                buckets.clear()
            states = {n: id(optimizer.state[p]) for n, p in model.named_parameters() if p in optimizer.state}
            steps_seen = freezer.steps
            if (record := freezer.step()) is not None:
                decisions.append({"optimizer_step": optimizer_steps, **record})
                frozen_then = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
                states_before = states
            observed.append(freezer.steps - steps_seen)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        optimizer_steps += accelerator.sync_gradients
        if optimizer_steps == STEPS:
            break
    params = dict(model.named_parameters())
    inner = optimizer.optimizer  # Accelerate's wrapper holds the user's optimizer
    torch.save({"decisions": decisions, "reduced": reduced, "full": full, "observed": observed,
                "freezer_steps": freezer.steps, "frozen_layers": freezer.frozen_layers,
                "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "frozen_unchanged": all(torch.equal(params[n], v) for n, v in frozen_then.items()),
                "in_optimizer": sorted(n for n, p in params.items()
                                       if any(p is q for g in inner.param_groups for q in g["params"])),
                "states_kept": sorted(n for n, i in states_before.items()
                                      if params[n].requires_grad and id(inner.state[params[n]]) == i),
                "trainable_names": sorted(n for n, p in params.items() if p.requires_grad),
                "training_modes": [layer.training for layer in find_layer_stack(model).layers],
                "params": {n: p.detach().clone() for n, p in params.items()}}, f"{out}/rank{rank}.pt")
    leave()


@pytest.fixture(scope="module")
def accelerate_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("accelerate")
    mp.spawn(_accelerate_worker, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]


def test_under_accumulation_the_freezer_observes_only_the_optimizers_steps(
        accelerate_run: list[dict[str, Any]]) -> None:
    result = accelerate_run[0]
    # each micro-batch's call observes only when the optimizer steps: the last micro-batch of each step
    assert result["observed"] == ([0] * (ACCUMULATION - 1) + [1]) * STEPS
    assert result["freezer_steps"] == STEPS
    # the window counts optimizer steps: its decision comes at the 4th (it would come at the 2nd counting
    # micro-batches)
    assert [(d["optimizer_step"], d["frozen_layers"]) for d in result["decisions"]] == [(WINDOW - 1,
                                                                                        EXPECTED_FROZEN)]


def test_a_freeze_under_accelerate_leaves_the_all_reduce_and_the_wrapped_optimizer(
        accelerate_run: list[dict[str, Any]]) -> None:
    result = accelerate_run[0]
    assert result["frozen_layers"] == EXPECTED_FROZEN
    assert result["training_modes"] == [False] * EXPECTED_FROZEN + [True] * (6 - EXPECTED_FROZEN)
    # the all-reduce of step k ran before the freeze decided at step k: all entries up to it, the trainable after
    assert result["reduced"] == [result["full"]] * WINDOW + [result["trainable"]] * (STEPS - WINDOW)
    assert result["trainable"] < result["full"]
    assert result["in_optimizer"] == result["trainable_names"]
    assert result["states_kept"] == result["trainable_names"]  # the very state objects, Adam moments and step
    assert result["frozen_unchanged"]
    for name, value in result["params"].items():  # DDP kept the replicas equal through the freeze
        torch.testing.assert_close(value, accelerate_run[1]["params"][name], rtol=0, atol=0, msg=name)
