"""Activation recomputation and bf16 on a real 2-stage pipeline (2 gloo processes): recomputed blocks run their
forward again in backward and give exactly the plain pipeline's gradients, dropout included; a bf16 forward
gives fp32 gradients within a stated tolerance of the plain ones."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from pipetransformer.config import DPConfig, PipeConfig, TrainConfig
from pipetransformer.metrics import StepTimer
from pipetransformer.pipe.planner import plan_layout
from pipetransformer.train.elastic import UNIFORM_COST
from pipetransformer.train.optimizer import HeldOptimizer
from pipetransformer.train.step import PipelineStep
from process_group import free_port, join, leave
from tiny import CPU, LAYERS, assert_bf16_close, env, layout, tiny_dataset, tiny_dropout_model

pytestmark = pytest.mark.slow

WORLD = 2
BATCH = 8
MICRO_BATCHES = 2
RECOMPUTED = tuple(range(1, LAYERS + 2))  # every layer and the head, on both stages
MODES = {"plain": ((), None), "recompute": (RECOMPUTED, None), "bf16": ((), torch.bfloat16)}


def _worker(rank: int, port: int, out: str) -> None:
    join(rank, WORLD, port)
    pipe = PipeConfig(enabled=True, stages=2, micro_batches=MICRO_BATCHES)
    plain = plan_layout(pipe, [UNIFORM_COST] * (LAYERS + 2), WORLD, elastic=True, batch_size=BATCH,
                        frozen_blocks=0, cached_blocks=0)
    results = {}
    for mode, (recompute, dtype) in MODES.items():
        model = tiny_dropout_model()
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
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results[mode] = {"calls": sum(count.calls for count in layers), "layers": len(layers), "grads": grads}
        elastic.close()
    torch.save(results, f"{out}/rank{rank}.pt")
    leave()


def test_recomputation_is_exact_and_bf16_within_tolerance_on_a_two_stage_pipeline(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
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
            assert_bf16_close(got, want, f"rank {rank}: {name}")
        assert any(not torch.equal(bf16["grads"][n], g) for n, g in plain["grads"].items()), "bf16 not applied"
