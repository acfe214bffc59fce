"""AutoPipe benchmark: a balanced partition against a uniform one, and our runner against plain torch.

Two real gloo processes on this machine (one thread each), GPipe schedule, the built-in ViT with a
heavy patch embedding (many input channels), so that block 0 costs several transformer layers:

(a) step time of the partition ``pipetransformer.pipe.partition.partition`` picks from
    ``profile_blocks`` costs, against a uniform split (equal block counts), both through our
    ``PipelineRunner``/``StageModule``;
(b) our ``PipelineRunner`` on the balanced partition against torch's own ``PipelineStage`` +
    ``ScheduleGPipe`` on the same blocks, with nothing of ours around it (a plain module that
    calls the blocks in turn).

One step = forward and backward of every micro-batch, then AdamW on each stage's parameters; its
time is the slower rank's, both ranks starting at a barrier. The three configurations are
interleaved block by block within each round, the order rotating between rounds; medians over all
rounds are reported. Inputs are random pixels: step time does not depend on their values.

    .venv/bin/python benchmarks/pipeline/main.py            # full run (a few minutes)
    .venv/bin/python benchmarks/pipeline/main.py --quick    # smoke run (under a minute)
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before any group exists: see distributed.shutdown_distributed
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from pipetransformer.distributed import shutdown_distributed
from pipetransformer.models import BlockSequence, build_model
from pipetransformer.pipe import (BlockCost, BlockState, Link, Partition, broadcast_costs, partition, predict_step_time,
                                  profile_blocks, stage_time)
from pipetransformer.pipe.cost import stage_timing
from pipetransformer.pipe.stage import PipelineRunner, StageModule

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import machine_info  # noqa: E402 - the shared helper lives one folder up

__all__ = ["Settings", "main", "run"]

WORLD_SIZE = 2
THREADS_PER_PROCESS = 1
"""Two processes on two cores: more threads each would oversubscribe the machine."""
BATCH_SIZE = 32
MICRO_BATCHES = 4
NUM_CLASSES = 10
LEARNING_RATE = 1e-4
SEED = 0
VIT = {"image_size": 128, "patch_size": 16, "in_channels": 36, "dim": 192, "depth": 6, "heads": 4}
"""64 patches of 16x16x36 values: the patch projection costs several encoder layers of width 192."""
FREE_LINK = Link(bandwidth_bytes_per_s=math.inf)
"""Every cut of a ViT sends the same hidden-state tensor, so the link cannot change which cut wins."""
PROFILE_WARMUP = 2
PROFILE_REPEATS = 5
TARGET_OVERHEAD = 0.05
LOOPBACK = "127.0.0.1"
MS_PER_SECOND = 1e3
CONFIGURATIONS = ("uniform", "balanced", "torch_balanced")


@dataclass(frozen=True)
class Settings:
    rounds: int
    steps_per_round: int
    warmup_steps: int


FULL = Settings(rounds=6, steps_per_round=5, warmup_steps=2)
QUICK = Settings(rounds=2, steps_per_round=3, warmup_steps=1)


class PlainStage(nn.Module):
    """What a user writes without this project: call the stage's blocks in turn (every ViT block
    takes and returns a 1-tuple), return a plain tensor."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            (hidden,) = block(hidden)
        return hidden


def uniform_bounds(num_blocks: int, num_stages: int) -> list[tuple[int, int]]:
    """Equal block counts per stage (the earlier stages take the remainder)."""
    sizes = [num_blocks // num_stages + (1 if s < num_blocks % num_stages else 0) for s in range(num_stages)]
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    return [(start, start + size) for start, size in zip(starts, sizes, strict=True)]


def _predicted_step_s(costs: list[BlockCost], states: list[BlockState], bounds: list[tuple[int, int]],
                      micro_batch_size: int) -> float:
    """The cost model's GPipe step (fill, drain and M - 1 beats of the slowest stage) for a given split."""
    timings = [stage_timing(costs, states, start, end, FREE_LINK) for start, end in bounds]
    split = Partition(bounds=bounds, stage_times=[t.at(micro_batch_size) for t in timings],
                      stage_memories=[0] * len(bounds), stage_timings=timings,
                      micro_batch_size=micro_batch_size, num_blocks=len(costs))
    return predict_step_time(split, BATCH_SIZE, MICRO_BATCHES, per_microbatch_overhead_s=0.0)


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target)


def _shared_costs(model: BlockSequence, pixels: torch.Tensor, rank: int) -> list[BlockCost]:
    """Profiled on rank 0 at the micro-batch size and broadcast, so both ranks plan from the same numbers."""
    costs = None
    if rank == 0:
        micro = pixels[: BATCH_SIZE // MICRO_BATCHES]
        costs = profile_blocks(model, (micro,), warmup=PROFILE_WARMUP, repeats=PROFILE_REPEATS)
    return broadcast_costs(costs, len(model))


def _embedding_training_s(model: BlockSequence, pixels: torch.Tensor) -> float:
    """Per-sample forward+backward of block 0 as training runs it: the pixels need no gradient.

    ``profile_blocks`` makes every floating-point block input require a gradient, so for block 0
    it also times the patch convolution's input gradient; this shows how much that adds.
    """
    micro = pixels[: BATCH_SIZE // MICRO_BATCHES]
    times: list[float] = []
    for run in range(PROFILE_WARMUP + PROFILE_REPEATS):
        start = time.perf_counter()
        (hidden,) = model.blocks[0](micro)
        hidden.backward(torch.ones_like(hidden))
        if run >= PROFILE_WARMUP:
            times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return statistics.median(times) / len(micro)


@dataclass
class _Pipeline:
    step: Callable[[], None]
    times: list[float]


def _ours(model: BlockSequence, bounds: list[tuple[int, int]], rank: int, pixels: torch.Tensor,
          labels: torch.Tensor) -> _Pipeline:
    start, end = bounds[rank]
    last = rank == WORLD_SIZE - 1
    module = StageModule([copy.deepcopy(model.blocks[i]) for i in range(start, end)], is_last=last)
    runner = PipelineRunner(module, rank, WORLD_SIZE, torch.device("cpu"), dist.group.WORLD, _loss)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LEARNING_RATE)

    def step() -> None:
        runner.step((BATCH_SIZE,), MICRO_BATCHES, "gpipe", (pixels,) if rank == 0 else None, labels if last else None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _Pipeline(step, [])


def _plain_torch(model: BlockSequence, bounds: list[tuple[int, int]], rank: int, pixels: torch.Tensor,
                 labels: torch.Tensor) -> _Pipeline:
    start, end = bounds[rank]
    module = PlainStage([copy.deepcopy(model.blocks[i]) for i in range(start, end)])
    stage = PipelineStage(module, rank, WORLD_SIZE, torch.device("cpu"), group=dist.group.WORLD)
    # The same gradient arithmetic as PipelineRunner, so only the glue around the schedule differs.
    schedule = ScheduleGPipe(stage, MICRO_BATCHES, loss_fn=_loss, scale_grads=False)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LEARNING_RATE)

    def step() -> None:
        if rank == 0:
            schedule.step(pixels)
        else:
            schedule.step(target=labels, losses=[])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _Pipeline(step, [])


def _timed(pipeline: _Pipeline) -> None:
    dist.barrier()
    start = time.perf_counter()
    pipeline.step()
    pipeline.times.append(time.perf_counter() - start)


def _worker(rank: int, port: int, settings: Settings, out: str) -> None:
    os.environ.update({"MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port)})
    torch.set_num_threads(THREADS_PER_PROCESS)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        torch.manual_seed(SEED)
        model = build_model("vit", num_labels=NUM_CLASSES, vit=VIT)
        model.train()
        channels, size = VIT["in_channels"], VIT["image_size"]
        pixels = torch.randn(BATCH_SIZE, channels, size, size)
        labels = torch.randint(0, NUM_CLASSES, (BATCH_SIZE,))
        costs = _shared_costs(model, pixels, rank)
        embedding_training_s = _embedding_training_s(model, pixels) if rank == 0 else math.nan
        states = [BlockState.ACTIVE] * len(model)
        micro = BATCH_SIZE // MICRO_BATCHES
        balanced = partition(costs, states, WORLD_SIZE, micro_batch_size=micro, memory_budget_bytes=math.inf,
                             link=FREE_LINK).bounds
        uniform = uniform_bounds(len(model), WORLD_SIZE)
        pipelines = {
            "uniform": _ours(model, uniform, rank, pixels, labels),
            "balanced": _ours(model, balanced, rank, pixels, labels),
            "torch_balanced": _plain_torch(model, balanced, rank, pixels, labels),
        }
        for pipeline in pipelines.values():
            for _ in range(settings.warmup_steps):
                pipeline.step()
            pipeline.times.clear()
        loads: list[float] = []
        for round_index in range(settings.rounds):
            shift = round_index % len(CONFIGURATIONS)
            for name in CONFIGURATIONS[shift:] + CONFIGURATIONS[:shift]:
                for _ in range(settings.steps_per_round):
                    _timed(pipelines[name])
            loads.append(os.getloadavg()[0])
        # A step lasts until the slower rank finishes it.
        slowest: dict[str, list[float]] = {}
        for name, pipeline in pipelines.items():
            times = torch.tensor(pipeline.times, dtype=torch.float64)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            slowest[name] = times.tolist()
        if rank == 0:
            # What the partitioner would pick if block 0 were costed as training runs it.
            as_trained = [replace(costs[0], backward_s=max(0.0, embedding_training_s - costs[0].forward_s),
                                  forward_fixed_s=0.0, backward_fixed_s=0.0), *costs[1:]]
            corrected = partition(as_trained, states, WORLD_SIZE, micro_batch_size=micro,
                                  memory_budget_bytes=math.inf, link=FREE_LINK).bounds
            predicted = {
                name: max(stage_time(costs, states, s, e, micro_batch_size=micro, link=FREE_LINK) for s, e in bounds)
                for name, bounds in (("uniform", uniform), ("balanced", balanced))
            }
            predicted_step = {name: _predicted_step_s(costs, states, bounds, micro)
                              for name, bounds in (("uniform", uniform), ("balanced", balanced))}
            result = {
                "costs": [asdict(c) for c in costs],
                "block_names": model.block_names(),
                "bounds": {"uniform": uniform, "balanced": balanced, "block0_as_trained": corrected},
                "predicted_bottleneck_s": predicted,
                "predicted_step_s": predicted_step,
                "embedding_training_s": embedding_training_s,
                "step_s": slowest,
                "load_average_per_round": loads,
            }
            Path(out).write_text(json.dumps(result))
    finally:
        shutdown_distributed()  # destroy and collect the groups before exit: a gloo thread left then aborts it


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def machine() -> dict[str, object]:
    return {**machine_info(), "processes": WORLD_SIZE, "threads_per_process": THREADS_PER_PROCESS}


def run(settings: Settings) -> dict[str, object]:
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as scratch:
        out = str(Path(scratch) / "result.json")
        mp.spawn(_worker, args=(_free_port(), settings, out), nprocs=WORLD_SIZE, join=True)
        result: dict[str, object] = json.loads(Path(out).read_text())
    step_s = result["step_s"]
    assert isinstance(step_s, dict)
    medians = {name: statistics.median(times) * MS_PER_SECOND for name, times in step_s.items()}
    result.update({
        "machine": machine(),
        "settings": asdict(settings),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "median_ms": medians,
        "uniform_over_balanced": medians["uniform"] / medians["balanced"],
        "runner_overhead": medians["balanced"] / medians["torch_balanced"] - 1.0,
    })
    return result


def report(result: dict[str, object]) -> str:
    costs = result["costs"]
    names = result["block_names"]
    assert isinstance(costs, list) and isinstance(names, list)
    micro = BATCH_SIZE // MICRO_BATCHES
    per_block = ", ".join(  # per sample of a micro-batch, its costs per call shared out (older records have none)
        f"{n} {sum(BlockCost(**c).seconds(micro)) / micro * MS_PER_SECOND:.2f}"
        for n, c in zip(names, costs, strict=True)
    )
    medians = result["median_ms"]
    bounds = result["bounds"]
    predicted = result["predicted_bottleneck_s"]
    assert isinstance(medians, dict) and isinstance(bounds, dict) and isinstance(predicted, dict)
    predicted_ratio = predicted["uniform"] / predicted["balanced"]
    predicted_step = result["predicted_step_s"]
    assert isinstance(predicted_step, dict)
    step_ratio = predicted_step["uniform"] / predicted_step["balanced"]
    overhead = result["runner_overhead"]
    assert isinstance(overhead, float)
    return "\n".join([
        f"machine: {json.dumps(result['machine'])}",
        f"load average (1, 5, 15 min) before {result['load_before']}, after {result['load_after']}, "
        f"per round {[round(x, 2) for x in result['load_average_per_round']]}",  # type: ignore[union-attr]
        f"profiled fwd+bwd ms per sample: {per_block}",
        f"block 0 fwd+bwd ms per sample without the pixels' gradient (as in training): "
        f"{result['embedding_training_s'] * MS_PER_SECOND:.2f}",  # type: ignore[operator]
        f"uniform stages {bounds['uniform']}, balanced stages {bounds['balanced']} "
        f"(with block 0 costed as trained: {bounds['block0_as_trained']})",
        "",
        "| configuration | median step ms |",
        "| --- | --- |",
        f"| uniform split, PipelineRunner | {medians['uniform']:.0f} |",
        f"| balanced split, PipelineRunner | {medians['balanced']:.0f} |",
        f"| balanced split, torch PipelineStage + ScheduleGPipe | {medians['torch_balanced']:.0f} |",
        "",
        f"(a) uniform / balanced = {result['uniform_over_balanced']:.2f} (cost model: {step_ratio:.2f} for the "
        f"step with fill and drain, {predicted_ratio:.2f} for the bottleneck stage alone)",
        f"(b) PipelineRunner overhead over plain torch = {overhead:+.1%} (target < {TARGET_OVERHEAD:.0%})",
    ])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps: a smoke run")
    parser.add_argument("--json", type=Path, help="also write the raw results to this file")
    args = parser.parse_args(argv)
    result = run(QUICK if args.quick else FULL)
    print(report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
