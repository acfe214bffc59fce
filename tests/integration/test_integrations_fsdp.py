"""The plain-PyTorch AutoFreezer on 2 real gloo processes under FSDP2 (``fully_shard``): the per-layer statistics the
policy reads equal DDP's on the same batches (each rank holds only a shard of every gradient), a freeze mid-run takes
the frozen layers out of the reduce-scatter and (all but the top one, which FSDP2's backward prefetch still gathers)
out of the backward's all-gather (counted by ``CommDebugMode``), keeps the surviving parameters' optimizer state
objects, and trains as DDP does; FSDP1 and the activation cache under FSDP2 are refused in one line."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel

from hf_text import LAYERS, TRAIN_ROWS, classification_batch, rotten_tomatoes, tiny_classifier
from pipetransformer.config import CacheConfig, FreezeConfig
from pipetransformer.freeze.apply import PreviousGradients, PreviousWeights
from pipetransformer.integrations import AutoFreezer
from process_group import free_port, join, leave

pytestmark = pytest.mark.slow

WORLD = 2
ROWS_PER_RANK = 8
STEPS = 8
LR = 1e-3
# A geometric window of 4 steps: 2 of the 6 layers (max_fraction 1/3) freeze after step 4, a second window adds none.
SETTINGS = FreezeConfig(policy="geometric", interval=4, interval_unit="steps", max_fraction=1 / 3)
EXPECTED_FROZEN = 2
GATHER, SCATTER = "c10d._allgather_base_", "c10d._reduce_scatter_base_"


def _wrap(model: torch.nn.Module, wrapper: str) -> torch.nn.Module:
    if wrapper == "ddp":
        return DistributedDataParallel(model)
    for layer in model.bert.encoder.layer:
        fully_shard(layer)
    fully_shard(model)  # the root: embeddings, pooler and head
    return model


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def _train(wrapper: str, rank: int) -> dict[str, Any]:
    """Train STEPS steps under ``wrapper`` (ddp or fsdp) with the freezer: what the policy saw, the collectives per
    step, the optimizer state objects' fate and the final weights (whole)."""
    data = rotten_tomatoes()
    model = tiny_classifier(data.input_ids.max().item() + 1)
    wrapped = _wrap(model, wrapper)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    freezer = AutoFreezer(wrapped, optimizer, settings=SETTINGS)
    # both signals (the geometric policy reads neither), every entry of the descents: exact sums to compare
    freezer.previous_grads, freezer.previous_weights = PreviousGradients(), PreviousWeights(stride=1)
    observed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    observe = freezer.policy.observe

    def recording_observe(norms: Any, dots: Any, descents: Any) -> None:  # what the policy is given, all-reduced
        observed.append((torch.tensor(norms), *(torch.tensor([math.nan if v is None else v for v in values])
                                                for values in (dots, descents))))
        observe(norms, dots, descents)

    freezer.policy.observe = recording_observe  # type: ignore[method-assign]
    records, counts, state_kept = [], [], None
    for step in range(STEPS):
        torch.manual_seed(1000 * step + rank)
        with CommDebugMode() as comm:
            wrapped(**classification_batch(data, step, ROWS_PER_RANK, rank, WORLD)).loss.backward()
        counts.append({str(op): n for op, n in comm.get_comm_counts().items()})
        states_before = {id(p): id(optimizer.state[p]) for p in model.parameters() if p in optimizer.state}
        if (record := freezer.step()) is not None:
            records.append(record)
            kept = [p for p in model.parameters() if p.requires_grad]
            state_kept = (all(id(optimizer.state[p]) == states_before[id(p)] for p in kept),
                          sum(len(group["params"]) for group in optimizer.param_groups) == len(kept))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"observed": observed, "records": records, "counts": counts, "state_kept": state_kept,
            "params": {n: _full(p) for n, p in model.named_parameters()}}


def _refusals() -> dict[str, str]:
    vocabulary = rotten_tomatoes().input_ids.max().item() + 1
    fsdp1 = FullyShardedDataParallel(tiny_classifier(vocabulary), device_id=torch.device("cpu"))
    cached = _wrap(tiny_classifier(vocabulary), "fsdp")
    refusals = {}
    for name, make in {"fsdp1": lambda: AutoFreezer(fsdp1, torch.optim.AdamW(fsdp1.parameters())),
                       "cache": lambda: AutoFreezer(cached, torch.optim.AdamW(cached.parameters()), settings=SETTINGS,
                                                    cache=CacheConfig(enabled=True), cache_samples=TRAIN_ROWS)}.items():
        try:
            make()
        except ValueError as error:
            refusals[name] = str(error)
    return refusals


def _worker(rank: int, port: int, out: str) -> None:
    """The same run under DDP and under FSDP2 in one process group, then the refusals."""
    join(rank, WORLD, port)
    torch.save({**{wrapper: _train(wrapper, rank) for wrapper in ("ddp", "fsdp")}, "refusals": _refusals()},
               f"{out}/rank{rank}.pt")
    leave()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("fsdp")
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    return torch.load(out / "rank0.pt", weights_only=False)


def test_the_policy_sees_the_same_statistics_under_fsdp2_as_under_ddp(runs: dict[str, Any]) -> None:
    ddp, fsdp = runs["ddp"], runs["fsdp"]
    assert len(fsdp["observed"]) == len(ddp["observed"]) == STEPS
    assert (fsdp["observed"][0][0] > 0).all()  # every layer has a gradient before the freeze
    for step, (ddp_step, fsdp_step) in enumerate(zip(ddp["observed"], fsdp["observed"])):
        for name, ddp_value, fsdp_value in zip(("norms", "dots", "descents"), ddp_step, fsdp_step):
            torch.testing.assert_close(fsdp_value, ddp_value, rtol=1e-4, atol=1e-9, equal_nan=True,
                                       msg=f"{name}, step {step}")
    assert not torch.isnan(ddp["observed"][-1][2]).all(), "the descents were measured"
    assert [r["frozen_layers"] for r in fsdp["records"]] == [EXPECTED_FROZEN]
    assert [r["step"] for r in fsdp["records"]] == [r["step"] for r in ddp["records"]]


def test_a_freeze_under_fsdp2_leaves_the_collectives_and_the_optimizer_and_trains_as_ddp(
        runs: dict[str, Any]) -> None:
    ddp, fsdp = runs["ddp"], runs["fsdp"]
    freeze_step = fsdp["records"][0]["step"]
    assert 0 < freeze_step < STEPS - 1
    before, after = fsdp["counts"][freeze_step], fsdp["counts"][freeze_step + 1:]
    assert before[SCATTER] == LAYERS + 1  # every layer's group and the root's
    for counts in after:  # the frozen layers' gradients are neither made nor reduce-scattered, and their weights are
        assert counts[SCATTER] == before[SCATTER] - EXPECTED_FROZEN  # not gathered again for a backward, but the
        assert counts[GATHER] == before[GATHER] - (EXPECTED_FROZEN - 1)  # top one's: FSDP2 prefetches the layer below
    assert fsdp["state_kept"] == (True, True)
    assert ddp["state_kept"] == (True, True)
    assert fsdp["params"].keys() == ddp["params"].keys()
    for name, value in fsdp["params"].items():
        torch.testing.assert_close(value, ddp["params"][name], rtol=1e-4, atol=1e-5, msg=name)


def test_fsdp1_and_the_cache_under_fsdp2_are_refused_in_one_line(runs: dict[str, Any]) -> None:
    refusals = runs["refusals"]
    assert "FullyShardedDataParallel (FSDP1)" in refusals["fsdp1"] and "fully_shard" in refusals["fsdp1"]
    assert "FSDP2 without cache=" in refusals["cache"]
    assert all("\n" not in message for message in refusals.values())
