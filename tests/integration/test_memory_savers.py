"""Activation recomputation and bf16 on a real 2-stage pipeline (2 gloo processes): recomputed blocks run their
forward again in backward and give exactly the plain pipeline's gradients, dropout included; a bf16 forward
gives fp32 gradients within a stated tolerance of the plain ones."""

from __future__ import annotations

import dataclasses
import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipetransformer.config import DPConfig, PipeConfig, TrainConfig
from pipetransformer.metrics import StepTimer
from pipetransformer.models.blocks import BlockSequence
from pipetransformer.pipe.planner import plan_layout
from pipetransformer.train.elastic import UNIFORM_COST
from pipetransformer.train.optimizer import HeldOptimizer
from pipetransformer.train.step import PipelineStep
from tiny import CPU, LAYERS, env, layout, tiny_dataset, tiny_model

pytestmark = pytest.mark.slow

WORLD = 2
BATCH = 8
MICRO_BATCHES = 2
RECOMPUTED = tuple(range(1, LAYERS + 2))  # every layer and the head, on both stages
BF16_GRADIENT_RTOL = 2e-2  # as in tests/unit/test_step.py
TIMEOUT_S = 60
MODES = {"plain": ((), None), "recompute": (RECOMPUTED, None), "bf16": ((), torch.bfloat16)}


class _Count(torch.nn.Module):
    """Identity that counts its forwards, first in its layer: recomputation stops after the last op that saved a
    tensor, and module hooks do not fire in it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


def _dropout_model() -> BlockSequence:
    model = tiny_model()
    for layer in model.blocks[1:-1]:
        layer.insert(0, _Count())
        layer.append(torch.nn.Dropout(0.5))
    return model


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=TIMEOUT_S))
    pipe = PipeConfig(enabled=True, stages=2, micro_batches=MICRO_BATCHES)
    plain = plan_layout(pipe, [UNIFORM_COST] * (LAYERS + 2), WORLD, elastic=True, batch_size=BATCH,
                        frozen_blocks=0, cached_blocks=0)
    results = {}
    for mode, (recompute, dtype) in MODES.items():
        model = _dropout_model()
        model.compute_dtype = dtype
        elastic = layout(model, tiny_dataset(), env(rank, WORLD), pipe=pipe, dp=DPConfig(enabled=True),
                         batch_size=BATCH)
        elastic.transition(dataclasses.replace(plain, recomputed_blocks=recompute), HeldOptimizer(model, TrainConfig()))
        assert isinstance(elastic.executor, PipelineStep)
        start, end = elastic.placement.blocks
        layers = [model.blocks[i][0] for i in range(max(start, 1), min(end, LAYERS + 1))]
        batch = elastic.executor.load(list(range(BATCH)))
        assert batch is not None
        torch.manual_seed(10 + rank)  # the same dropout draws in every mode
        elastic.executor.forward_backward(batch, BATCH, StepTimer(CPU))
        results[mode] = {"calls": sum(count.calls for count in layers), "layers": len(layers), "grads": {name: p.grad.clone() for name, p in model.named_parameters()
                                                      if p.grad is not None}}
        elastic.close()
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.barrier()  # no rank tears gloo down while a peer's point-to-point work is in flight
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_recomputation_is_exact_and_bf16_within_tolerance_on_a_two_stage_pipeline(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        plain, recompute, bf16 = (results[mode] for mode in MODES)
        # At least once per micro-batch and layer (the last stage measured one more per layer, per step).
        assert recompute["calls"] >= plain["calls"] + MICRO_BATCHES * plain["layers"], "no forward ran again"
        assert plain["grads"] and plain["grads"].keys() == recompute["grads"].keys() == bf16["grads"].keys()
        for name, want in plain["grads"].items():
            assert torch.equal(recompute["grads"][name], want), f"rank {rank}: {name}"
            got = bf16["grads"][name]
            assert got.dtype == torch.float32
            assert float((got - want).norm()) <= BF16_GRADIENT_RTOL * float(want.norm()) + 1e-6, f"rank {rank}: {name}"
        assert any(not torch.equal(bf16["grads"][n], g) for n, g in plain["grads"].items()), "bf16 not applied"
