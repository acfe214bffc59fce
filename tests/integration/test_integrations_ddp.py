"""The plain-PyTorch AutoFreezer on 2 real gloo processes under DistributedDataParallel: a freeze mid-run leaves
DDP working (no "finished reduction" error), takes the frozen gradients out of the all-reduce (seen from a comm
hook), runs the frozen prefix without autograd, and leaves the optimizer exactly as a run frozen by hand at the same
step; a builtin comm hook stays on; a checkpoint, a SIGKILL and a resume continue with the same frozen boundary and
optimizer state."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from hf_text import classification_batch, rotten_tomatoes, tiny_classifier
from pipetransformer.config import FreezeConfig
from pipetransformer.integrations import AutoFreezer, find_layer_stack
from process_group import free_port, join, leave, record_buckets

pytestmark = pytest.mark.slow

WORLD = 2
ROWS_PER_RANK = 8
STEPS = 10
CHECKPOINT_AT = 6  # after the freeze, before the end
LR = 1e-3
# A geometric window of 4 steps: 2 of the 6 layers (max_fraction 1/3) freeze after step 4, a second window adds none.
SETTINGS = FreezeConfig(policy="geometric", interval=4, interval_unit="steps", max_fraction=1 / 3)
EXPECTED_FROZEN = 2


def _setup(rank: int) -> tuple[Any, DistributedDataParallel, torch.optim.Optimizer, list[int]]:
    data = rotten_tomatoes()
    model = tiny_classifier(data.input_ids.max().item() + 1)
    ddp = DistributedDataParallel(model)
    buckets: list[int] = []
    ddp.register_comm_hook(buckets, record_buckets)
    return data, ddp, torch.optim.AdamW(model.parameters(), lr=LR), buckets


def _train_step(ddp: DistributedDataParallel, data: Any, step: int, rank: int) -> None:
    torch.manual_seed(1000 * step + rank)  # dropout: a function of the step, so a resumed run draws the same
    ddp(**classification_batch(data, step, ROWS_PER_RANK, rank, WORLD)).loss.backward()


def _autofreeze_worker(rank: int, port: int, out: str, resume: bool) -> None:
    """``resume`` False: train from the start, checkpoint at CHECKPOINT_AT, and (when ``out`` ends in ``-killed``)
    die by SIGKILL right after; True: resume from that checkpoint. Either way, save the end state."""
    join(rank, WORLD, port)
    data, ddp, optimizer, buckets = _setup(rank)
    freezer = AutoFreezer(ddp, optimizer, settings=SETTINGS)
    first = 0
    if resume:
        checkpoint = torch.load(f"{out}/checkpoint.pt", weights_only=False)
        ddp.module.load_state_dict(checkpoint["model"])
        freezer.load_state_dict(checkpoint["freezer"])  # before the optimizer: it holds only the training params
        optimizer.load_state_dict(checkpoint["optimizer"])
        first = CHECKPOINT_AT
    records, no_grad_outputs = [], []
    stack = find_layer_stack(ddp.module)
    stack.layers[EXPECTED_FROZEN - 1].register_forward_hook(
        lambda module, args, output: no_grad_outputs.append(not output[0].requires_grad))
    full = sum(p.numel() for p in ddp.module.parameters())
    reduced_per_step = []
    for step in range(first, STEPS):
        buckets.clear()
        _train_step(ddp, data, step, rank)
        reduced_per_step.append(sum(buckets))
        record = freezer.step()
        if record is not None:
            records.append(record)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step + 1 == CHECKPOINT_AT and not resume:
            if rank == 0:
                torch.save({"model": ddp.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "freezer": freezer.state_dict()}, f"{out}/checkpoint.pt")
            dist.barrier()
            if out.endswith("-killed"):
                os.kill(os.getpid(), signal.SIGKILL)
    trainable = sum(p.numel() for p in ddp.module.parameters() if p.requires_grad)
    torch.save({"records": records, "reduced": reduced_per_step, "full": full, "trainable": trainable,
                "frozen_layers": freezer.frozen_layers, "no_grad_outputs": no_grad_outputs,
                "training_modes": [layer.training for layer in stack.layers],
                "params": {n: p.detach().clone() for n, p in ddp.module.named_parameters()},
                "state": _named_state(ddp.module, optimizer)}, f"{out}/rank{rank}.pt")
    leave()


def _by_hand_worker(rank: int, port: int, out: str, freeze_step: int) -> None:
    """The reference: at ``freeze_step`` (after backward, before the update) freeze the first EXPECTED_FROZEN layers
    and the embeddings, wrap the model in a new DDP and give a new optimizer the survivors' state."""
    join(rank, WORLD, port)
    data, ddp, optimizer, _ = _setup(rank)
    model = ddp.module
    for step in range(STEPS):
        _train_step(ddp, data, step, rank)
        if step == freeze_step:
            frozen = [*model.bert.embeddings.parameters(),
                      *(p for layer in model.bert.encoder.layer[:EXPECTED_FROZEN] for p in layer.parameters())]
            for parameter in frozen:
                parameter.requires_grad_(False)
                parameter.grad = None
            kept = [p for p in model.parameters() if p.requires_grad]
            rebuilt = torch.optim.AdamW(kept, lr=LR)
            for parameter in kept:
                if parameter in optimizer.state:
                    rebuilt.state[parameter] = optimizer.state[parameter]
            optimizer = rebuilt
            model.bert.embeddings.eval()
            for layer in model.bert.encoder.layer[:EXPECTED_FROZEN]:
                layer.eval()
            ddp = DistributedDataParallel(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "state": _named_state(model, optimizer)}, f"{out}/rank{rank}.pt")
    leave()


def _builtin_hook_worker(rank: int, port: int, out: str) -> None:
    """DDP with the builtin FP16_COMPRESS hook: each step, whether every trainable gradient came back through it (as
    a float16 value) from the all-reduce."""
    join(rank, WORLD, port)
    data = rotten_tomatoes()
    ddp = DistributedDataParallel(tiny_classifier(data.input_ids.max().item() + 1))
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR)
    freezer = AutoFreezer(ddp, optimizer, settings=SETTINGS)
    compressed, records = [], []
    for step in range(STEPS):
        _train_step(ddp, data, step, rank)
        grads = [p.grad for p in ddp.parameters() if p.requires_grad]
        compressed.append(all(torch.equal(g, g.half().float()) for g in grads))
        if (record := freezer.step()) is not None:
            records.append(record)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    from torch.distributed.fsdp import MixedPrecision

    mixed = DistributedDataParallel(tiny_classifier(data.input_ids.max().item() + 1),
                                    mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    try:
        AutoFreezer(mixed, torch.optim.AdamW(mixed.parameters()), settings=SETTINGS)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    torch.save({"compressed": compressed, "records": records, "refusal": refusal}, f"{out}/rank{rank}.pt")
    leave()


def _named_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    return {name: {k: v.clone() for k, v in optimizer.state[p].items()}
            for name, p in model.named_parameters() if p in optimizer.state}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if isinstance(a[name], dict):
            _equal(a[name], b[name])
        else:
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def _spawn(worker: Any, *args: Any) -> None:
    mp.spawn(worker, args=(free_port(), *args), nprocs=WORLD, join=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A whole AutoFreezer run (both tests compare against it)."""
    out = tmp_path_factory.mktemp("auto")
    _spawn(_autofreeze_worker, str(out), False)
    return out


def test_a_freeze_under_ddp_leaves_the_all_reduce_and_the_optimizer_as_a_hand_frozen_run(
        uninterrupted: Path, tmp_path: Path) -> None:
    auto, by_hand = uninterrupted, tmp_path / "by-hand"
    by_hand.mkdir()
    result = torch.load(auto / "rank0.pt", weights_only=False)
    assert [r["frozen_layers"] for r in result["records"]] == [EXPECTED_FROZEN]
    freeze_step = result["records"][0]["step"]
    assert 0 < freeze_step < STEPS - 1
    # the frozen layers' gradients leave the all-reduce: every entry before the freeze, only the trainable after
    assert result["reduced"][:freeze_step + 1] == [result["full"]] * (freeze_step + 1)
    assert result["reduced"][freeze_step + 1:] == [result["trainable"]] * (STEPS - freeze_step - 1)
    assert result["trainable"] < result["full"]
    assert result["no_grad_outputs"][freeze_step + 1:] == [True] * (STEPS - freeze_step - 1)
    assert not any(result["no_grad_outputs"][:freeze_step + 1])
    assert result["training_modes"] == [False] * EXPECTED_FROZEN + [True] * (6 - EXPECTED_FROZEN)
    _spawn(_by_hand_worker, str(by_hand), freeze_step)
    for rank in range(WORLD):
        mine = torch.load(auto / f"rank{rank}.pt", weights_only=False)
        reference = torch.load(by_hand / f"rank{rank}.pt", weights_only=False)
        _equal(mine["state"], reference["state"])
        _equal(mine["params"], reference["params"])


def test_checkpoint_kill_and_resume_keep_the_frozen_boundary_and_optimizer_state(uninterrupted: Path,
                                                                                 tmp_path: Path) -> None:
    whole, killed = uninterrupted, tmp_path / "run-killed"
    killed.mkdir()
    with pytest.raises(mp.ProcessExitedException):
        _spawn(_autofreeze_worker, str(killed), False)
    assert not (killed / "rank0.pt").exists()
    _spawn(_autofreeze_worker, str(killed), True)
    for rank in range(WORLD):
        uninterrupted = torch.load(whole / f"rank{rank}.pt", weights_only=False)
        resumed = torch.load(killed / f"rank{rank}.pt", weights_only=False)
        assert resumed["frozen_layers"] == uninterrupted["frozen_layers"] == EXPECTED_FROZEN
        assert resumed["records"] == []  # the boundary came from the checkpoint, not a new decision
        assert resumed["reduced"] == [uninterrupted["trainable"]] * (STEPS - CHECKPOINT_AT)
        _equal(resumed["state"], uninterrupted["state"])
        _equal(resumed["params"], uninterrupted["params"])


def test_a_builtin_comm_hook_survives_the_freeze_and_ddp_mixed_precision_is_refused_at_once(tmp_path: Path) -> None:
    _spawn(_builtin_hook_worker, str(tmp_path))
    result = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert [r["frozen_layers"] for r in result["records"]] == [EXPECTED_FROZEN]
    # float16 gradients at every step, before and after the reducer was rebuilt without the frozen layers
    assert result["compressed"] == [True] * STEPS
    # a wrapper whose reducer cannot be rebuilt is refused when the freezer is built, not at its first freeze
    assert "mixed_precision" in result["refusal"]
