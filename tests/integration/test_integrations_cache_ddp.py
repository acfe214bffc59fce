"""The plain API's activation cache on 2 real gloo processes under DistributedDataParallel: the ranks of a node share
one store, so a sample that one rank computed is served to the other when it draws it, and the served forward equals
the plain one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from hf_text import MAX_LENGTH, rotten_tomatoes, tiny_classifier
from pipetransformer.config import CacheConfig, FreezeConfig
from pipetransformer.integrations import AutoFreezer
from process_group import free_port, join, leave

pytestmark = pytest.mark.slow

WORLD = 2
ROWS_PER_RANK = 8
FROZEN = 2
STEPS = 2


def _worker(rank: int, port: int, out: str) -> None:
    join(rank, WORLD, port)
    data = rotten_tomatoes()
    model = tiny_classifier(int(data.input_ids.max()) + 1)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    freezer = AutoFreezer(ddp, optimizer, settings=FreezeConfig(policy="none", prior=FROZEN),
                          cache=CacheConfig(enabled=True, memory_gb=0.05), cache_samples=len(data),
                          cache_max_length=MAX_LENGTH)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))[:ROWS_PER_RANK * WORLD]
    counts, equal = [], []
    for step in range(STEPS):
        indices = order[(rank + step) % WORLD::WORLD]  # step 1: the samples the other rank recorded at step 0
        batch = data.get_batch(indices)
        inputs = {"input_ids": batch.inputs[0], "attention_mask": batch.inputs[1], "labels": batch.labels}
        torch.manual_seed(step)
        with torch.no_grad():
            plain = model(**inputs).logits
        torch.manual_seed(step)
        with freezer.serving(indices):
            output = ddp(**inputs)
        equal.append(torch.equal(output.logits, plain))
        output.loss.backward()
        freezer.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        counts.append((freezer.cache.computed, freezer.cache.hits))
    torch.save({"counts": counts, "equal": equal}, f"{out}/rank{rank}.pt")
    freezer.close()
    leave()


def test_ranks_share_one_store_and_serve_each_others_records(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["counts"] == [(ROWS_PER_RANK, 0), (ROWS_PER_RANK, ROWS_PER_RANK)], f"rank {rank}"
        assert result["equal"] == [True, True], f"rank {rank}"
