"""``pipetransformer plan``: what AutoPipe would do for a config, without training.

Builds the model, profiles its blocks on this machine (or uses the analytical model when
``pipe.profile: false``), and prints the per-block costs, the chosen partition, stage costs, the
predicted bubble and step time. Also the analytical planner for clusters we cannot run here: set
``--nproc-per-node`` to the cluster's device count and ``pipe.device_memory_gb`` to its memory.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

from .config import Config
from .data import datasets_from_config
from .models import build_model, load_tokenizer, minilm_path
from .pipe.cost import BlockCost
from .pipe.partition import bubble_fraction, predict_step_time
from .pipe.planner import PER_MICROBATCH_OVERHEAD_S, block_states, plan_layout
from .pipe.profile import estimate_block_costs

__all__ = ["plan_command", "plan_report"]

PROFILE_BATCH = 8


def _costs(config: Config) -> tuple[list[BlockCost], list[str]]:
    tokenizer = None if config.model.kind == "vit" else load_tokenizer(config.model.path or minilm_path())
    train = datasets_from_config(replace(config.data, max_train_samples=PROFILE_BATCH), tokenizer).train
    model = build_model(config.model.kind, num_labels=train.num_classes, path=config.model.path,
                        hf_config=config.model.hf_config, pooling=config.model.pooling,
                        vit=dict(config.model.vit) if config.model.kind == "vit" else None,
                        attn_implementation=config.model.attn_implementation)
    pad = config.data.max_length if train.task == "text" else None
    inputs = train.get_batch(list(range(min(PROFILE_BATCH, len(train)))), pad_to=pad).inputs
    costs = estimate_block_costs(model, inputs, num_classes=train.num_classes, measure=config.pipe.profile)
    return costs, model.block_names()


def plan_report(config: Config, world_size: int, costs: list[BlockCost], names: list[str],
                frozen_blocks: int = 0, cached_blocks: int = 0) -> dict[str, Any]:
    plan = plan_layout(config, costs, world_size, frozen_blocks=frozen_blocks, cached_blocks=cached_blocks)
    per_replica = max(1, config.train.batch_size // plan.layout.dp_width)
    states = block_states(len(costs), frozen_blocks, cached_blocks)
    return {
        "world_size": world_size,
        "blocks": [{"name": n, "state": s.value, "forward_ms_per_sample": c.forward_s * 1e3,
                    "backward_ms_per_sample": c.backward_s * 1e3, "output_bytes": c.output_bytes,
                    "param_bytes": c.param_bytes, "activation_bytes": c.activation_bytes}
                   for n, c, s in zip(names, costs, states, strict=True)],
        **plan.describe(),
        "stage_ms": [t * 1e3 for t in plan.partition.stage_times],
        "stage_ms_samples": plan.partition.micro_batch_size,  # stage_ms is per this many samples
        "stage_memory_bytes": plan.partition.stage_memories,
        "bubble_fraction": bubble_fraction(plan.layout.num_stages, plan.micro_batches),
        "predicted_step_s": predict_step_time(plan.partition, per_replica, plan.micro_batches,
                                              PER_MICROBATCH_OVERHEAD_S),
    }


def plan_command(config: Config, world_size: int, as_json: bool) -> int:
    costs, names = _costs(config)
    report = plan_report(config, world_size, costs, names)
    if as_json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{'block':<12} {'fwd ms/s':>9} {'bwd ms/s':>9} {'out KB':>8} {'param MB':>9} {'act KB':>8}")
    for b in report["blocks"]:
        print(f"{b['name']:<12} {b['forward_ms_per_sample']:>9.3f} {b['backward_ms_per_sample']:>9.3f} "
              f"{b['output_bytes'] / 1e3:>8.1f} {b['param_bytes'] / 1e6:>9.2f} {b['activation_bytes'] / 1e3:>8.1f}")
    print(f"\nworkers {world_size}: {report['stages']} stage(s) x {report['dp_width']} replica(s), "
          f"{report['micro_batches']} micro-batch(es)")
    for i, ((start, end), ms, mem) in enumerate(zip(report["bounds"], report["stage_ms"],
                                                    report["stage_memory_bytes"], strict=True)):
        print(f"  stage {i}: blocks {start}..{end - 1}  {ms:.1f} ms per {report['stage_ms_samples']} samples  "
              f"{mem / 1e6:.1f} MB")
    bubble = report["bubble_fraction"]
    print(f"bubble {bubble:.1%}, predicted step {report['predicted_step_s'] * 1e3:.0f} ms"
          + ("" if math.isfinite(report["predicted_step_s"]) else " (unbounded)"))
    return 0
