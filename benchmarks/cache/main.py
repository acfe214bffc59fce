"""AutoCache benchmark: what serving the frozen prefix from the activation store saves per training step.

MiniLM-L6 on Rotten Tomatoes batches, one process with two threads. For k of the 6 layers frozen
(embeddings too) it times a whole training step (forward, backward, AdamW step) in four ways:

* ``active``    nothing frozen;
* ``frozen``    k frozen, not cached: a no-grad forward through the frozen prefix every step;
* ``cached``    k frozen, the prefix's output served by ``FrozenPrefixCache`` from a real
                ``ActivationStore`` in /dev/shm, warm (every sample was seen once before timing);
* ``ideal``     the active blocks only, from ``profile_blocks``' per-block costs of the same batches,
                plus the AdamW step of the active parameters as measured in ``cached``.

Configurations are interleaved block by block within each round (the machine is shared, so a
disturbance hits all of them alike), every one runs the same batches in the same order, and the
reported numbers are medians over all rounds. Batches are trimmed to their longest sequence, as
the trainer does, and, to compare with the first measurement made before the cache was built,
padded to a fixed 64 tokens.

    .venv/bin/python benchmarks/cache/main.py            # full run (a few minutes)
    .venv/bin/python benchmarks/cache/main.py --quick    # smoke run (about a minute)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from pipetransformer.cache import ActivationStore, FrozenPrefixCache, spec_from_activation
from pipetransformer.data import Batch, load_datasets, seeded_permutation
from pipetransformer.freeze.apply import freeze_blocks
from pipetransformer.models import BlockSequence, build_model, load_tokenizer, minilm_path
from pipetransformer.pipe import BlockCost, profile_blocks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import machine_info  # noqa: E402 - the shared helper lives one folder up

__all__ = ["Settings", "main", "run"]

THREADS = 2
BATCH_SIZE = 32
FIXED_LENGTH = 64
"""The first MiniLM timings padded every batch to 64 tokens; the trainer trims to the batch's longest."""
FROZEN_LAYER_COUNTS = (2, 4)
NUM_LABELS = 2
LEARNING_RATE = 2e-5
SEED = 0
STORE_HEADROOM_BYTES = 1 << 20
"""Room for the store's index arrays on top of the records, so every sample lives in shared memory."""
TARGET_IDEAL_RATIO = 0.9
MS_PER_SECOND = 1e3
FIRST_MEASURED_CACHED_SPEEDUP = (3.3, 3.5)
"""Measured on this machine before the cache was built: 4 of 6 frozen and cached, MiniLM, batch 32, 64
tokens, per step."""
MODES = {"trimmed": None, "fixed64": FIXED_LENGTH}
"""Sequence mode -> ``pad_to`` of ``get_batch`` (None: trim to the batch's longest)."""


@dataclass(frozen=True)
class Settings:
    rounds: int
    steps_per_round: int
    warmup_steps: int
    profile_repeats: int


FULL = Settings(rounds=5, steps_per_round=6, warmup_steps=2, profile_repeats=1)
QUICK = Settings(rounds=2, steps_per_round=3, warmup_steps=1, profile_repeats=1)


@dataclass
class StepTimes:
    """Seconds of each timed step, split into the frozen prefix, the active forward+backward and AdamW."""

    prefix: list[float] = field(default_factory=list)
    forward_backward: list[float] = field(default_factory=list)
    optimizer: list[float] = field(default_factory=list)

    @property
    def total(self) -> list[float]:
        return [p + f + o for p, f, o in zip(self.prefix, self.forward_backward, self.optimizer, strict=True)]


@dataclass
class Configuration:
    """One way of training: its own model copy and optimizer, so configurations never share state."""

    name: str
    model: BlockSequence
    optimizer: torch.optim.Optimizer
    boundary: int
    """First active block; blocks below it are frozen (0: nothing frozen)."""
    cache: FrozenPrefixCache | None
    times: StepTimes = field(default_factory=StepTimes)


def _prefix(config: Configuration, batch: Batch) -> tuple[torch.Tensor, ...]:
    if config.boundary == 0:
        return batch.inputs
    if config.cache is not None:
        return config.cache.activation_at_boundary(config.model, batch.inputs, batch.indices, config.boundary)
    with torch.no_grad():
        return config.model.forward_range(batch.inputs, 0, config.boundary)


def train_step(config: Configuration, batch: Batch) -> tuple[float, float, float]:
    """One training step; returns seconds of (frozen prefix, active forward+backward, AdamW step)."""
    start = time.perf_counter()
    activation = _prefix(config, batch)
    prefix_done = time.perf_counter()
    logits = config.model.forward_range(activation, config.boundary, len(config.model))[0]
    F.cross_entropy(logits, batch.labels).backward()
    backward_done = time.perf_counter()
    config.optimizer.step()
    config.optimizer.zero_grad(set_to_none=True)
    end = time.perf_counter()
    return prefix_done - start, backward_done - prefix_done, end - backward_done


def _configuration(name: str, base: BlockSequence, frozen_layers: int, store: ActivationStore | None) -> Configuration:
    model = copy.deepcopy(base)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    boundary = frozen_layers + 1 if frozen_layers else 0
    freeze_blocks(model, range(boundary), optimizer)
    cache = FrozenPrefixCache(store) if store is not None else None
    return Configuration(name, model, optimizer, boundary, cache)


def _create_store(model: BlockSequence, batch: Batch, boundary: int, num_samples: int) -> ActivationStore:
    """A store holding every sample in /dev/shm; its names are removed at once, so nothing outlives the run."""
    with torch.no_grad():
        example = model.forward_range(batch.inputs, 0, boundary)
    spec = spec_from_activation(example, pad_to=FIXED_LENGTH)
    store = ActivationStore.create(num_samples, spec, num_samples * spec.bytes_per_sample + STORE_HEADROOM_BYTES)
    store.unlink_names()
    if store.layout.memory_records != num_samples:
        store.close()
        raise RuntimeError(
            f"/dev/shm holds only {store.layout.memory_records} of {num_samples} records: free space in /dev/shm"
        )
    return store


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * MS_PER_SECOND


def _profiled_ms(profiles: list[list[list[BlockCost]]], batches: list[Batch], boundary: int) -> float:
    """Median over rounds and batches of the profiled forward+backward of blocks ``boundary..`` for the batch
    (per sample and per call)."""
    return statistics.median(
        sum(sum(c.seconds(len(batch))) for c in costs[boundary:]) * MS_PER_SECOND
        for round_costs in profiles
        for costs, batch in zip(round_costs, batches, strict=True)
    )


def run_mode(
    base: BlockSequence, batches: list[Batch], num_samples: int, settings: Settings, log: Callable[[str], None]
) -> dict[str, object]:
    """All configurations on one list of batches, interleaved; per-block profiles taken in every round."""
    stores: list[ActivationStore] = []
    try:
        configs = [_configuration("active", base, 0, None)]
        for k in FROZEN_LAYER_COUNTS:
            configs.append(_configuration(f"frozen{k}", base, k, None))
            stores.append(_create_store(base, batches[0], k + 1, num_samples))
            configs.append(_configuration(f"cached{k}", base, k, stores[-1]))
        for config in configs:
            if config.cache is not None:
                for batch in batches:  # warm: every sample seen once
                    config.cache.activation_at_boundary(config.model, batch.inputs, batch.indices, config.boundary)
            for step in range(settings.warmup_steps):
                train_step(config, batches[step % len(batches)])
        profiles: list[list[list[BlockCost]]] = []
        loads: list[float] = []
        for round_index in range(settings.rounds):
            order = configs[round_index % len(configs) :] + configs[: round_index % len(configs)]
            for config in order:
                for batch in batches:
                    prefix, forward_backward, optimizer = train_step(config, batch)
                    config.times.prefix.append(prefix)
                    config.times.forward_backward.append(forward_backward)
                    config.times.optimizer.append(optimizer)
            repeats = settings.profile_repeats
            profiles.append([profile_blocks(configs[0].model, b.inputs, warmup=1, repeats=repeats) for b in batches])
            loads.append(os.getloadavg()[0])
            summary = ", ".join(f"{c.name} {_median_ms(c.times.total[-len(batches):]):.0f}" for c in configs)
            log(f"  round {round_index + 1}/{settings.rounds} (load {loads[-1]:.2f}): ms {summary}")
        for config in configs:
            if config.cache is not None:
                metrics = config.cache.metrics()
                if metrics.computed != num_samples or metrics.hits != metrics.samples - num_samples:
                    raise RuntimeError(f"{config.name}: the cache missed warm samples ({metrics})")
        return _summarize(configs, profiles, batches, loads)
    finally:
        paths = [s.layout.memory_path for s in stores]
        for store in stores:
            store.close()
        leftover = [p for p in paths if p is not None and Path(p).exists()]
        if leftover:
            raise RuntimeError(f"cache files left behind: {leftover}")


def _summarize(
    configs: list[Configuration], profiles: list[list[list[BlockCost]]], batches: list[Batch], loads: list[float]
) -> dict[str, object]:
    by_name = {c.name: c for c in configs}
    active_ms = _median_ms(by_name["active"].times.total)
    rows: dict[str, dict[str, float]] = {
        "active": {
            "step_ms": active_ms,
            "optimizer_ms": _median_ms(by_name["active"].times.optimizer),
            "profile_all_blocks_ms": _profiled_ms(profiles, batches, 0),
        }
    }
    for k in FROZEN_LAYER_COUNTS:
        boundary = k + 1
        frozen, cached = by_name[f"frozen{k}"], by_name[f"cached{k}"]
        ideal_compute_ms = _profiled_ms(profiles, batches, boundary)
        optimizer_ms = _median_ms(cached.times.optimizer)
        ideal_ms = ideal_compute_ms + optimizer_ms
        cached_ms = _median_ms(cached.times.total)
        frozen_ms = _median_ms(frozen.times.total)
        rows[f"frozen{k}"] = {
            "step_ms": frozen_ms,
            "prefix_ms": _median_ms(frozen.times.prefix),
            "speedup": active_ms / frozen_ms,
        }
        rows[f"cached{k}"] = {
            "step_ms": cached_ms,
            "prefix_ms": _median_ms(cached.times.prefix),
            "speedup": active_ms / cached_ms,
            "ideal_ms": ideal_ms,
            "ideal_compute_ms": ideal_compute_ms,
            "ideal_optimizer_ms": optimizer_ms,
            "ideal_speedup": active_ms / ideal_ms,
            "achieved_over_ideal": ideal_ms / cached_ms,
        }
    return {
        "rows": rows,
        "mean_tokens": statistics.mean(b.inputs[0].shape[1] for b in batches),
        "load_average_per_round": loads,
    }


def machine() -> dict[str, object]:
    return {**machine_info(), "threads": torch.get_num_threads()}


def run(settings: Settings, log: Callable[[str], None] = print) -> dict[str, object]:
    torch.set_num_threads(THREADS)
    torch.manual_seed(SEED)
    tokenizer = load_tokenizer(minilm_path())
    num_samples = settings.steps_per_round * BATCH_SIZE
    train = load_datasets(
        "rotten_tomatoes", tokenizer=tokenizer, max_length=FIXED_LENGTH, seed=SEED, max_train_samples=num_samples
    ).train
    order = seeded_permutation(num_samples, SEED)
    chunks = [order[i : i + BATCH_SIZE] for i in range(0, num_samples, BATCH_SIZE)]
    base = build_model("minilm", num_labels=NUM_LABELS)
    result: dict[str, object] = {"machine": machine(), "settings": settings.__dict__, "load_before": os.getloadavg()}
    for mode, pad_to in MODES.items():
        batches = [train.get_batch(chunk, pad_to=pad_to) for chunk in chunks]
        log(f"{mode}: {len(batches)} batches of {BATCH_SIZE}, tokens {[b.inputs[0].shape[1] for b in batches]}")
        result[mode] = run_mode(base, batches, num_samples, settings, log)
    result["load_after"] = os.getloadavg()
    return result


def report(result: dict[str, object]) -> str:
    lines = [
        f"machine: {json.dumps(result['machine'])}",
        f"load average (1, 5, 15 min) before {result['load_before']}, after {result['load_after']}",
    ]
    for mode in MODES:
        data = result[mode]
        assert isinstance(data, dict)
        rows = data["rows"]
        lines += [
            "",
            f"## {mode} (mean batch width {data['mean_tokens']:.1f} tokens; "
            f"load per round {[round(x, 2) for x in data['load_average_per_round']]})",
            "| configuration | step ms | speed-up | ideal ms | ideal speed-up | achieved / ideal |",
            "| --- | --- | --- | --- | --- | --- |",
            f"| all active | {rows['active']['step_ms']:.0f} | 1.00 | | | |",
        ]
        for k in FROZEN_LAYER_COUNTS:
            frozen, cached = rows[f"frozen{k}"], rows[f"cached{k}"]
            lines.append(f"| {k} of 6 frozen, not cached | {frozen['step_ms']:.0f} | {frozen['speedup']:.2f} | | | |")
            lines.append(
                f"| {k} of 6 frozen, cached | {cached['step_ms']:.0f} | {cached['speedup']:.2f} | "
                f"{cached['ideal_ms']:.0f} | {cached['ideal_speedup']:.2f} | {cached['achieved_over_ideal']:.2f} |"
            )
        lines.append(
            f"all active: AdamW {rows['active']['optimizer_ms']:.0f} ms; profiled blocks sum to "
            f"{rows['active']['profile_all_blocks_ms']:.0f} ms"
        )
        for k in FROZEN_LAYER_COUNTS:
            cached, frozen = rows[f"cached{k}"], rows[f"frozen{k}"]
            lines.append(
                f"k={k}: prefix ms not cached {frozen['prefix_ms']:.1f}, cached {cached['prefix_ms']:.1f}; ideal = "
                f"{cached['ideal_compute_ms']:.0f} ms active blocks + {cached['ideal_optimizer_ms']:.0f} ms AdamW"
            )
    low, high = FIRST_MEASURED_CACHED_SPEEDUP
    lines.append(f"\nfirst measurement, before the cache was built: 4 of 6 frozen + cached, 64 tokens: {low}-{high}x; "
                 f"target achieved/ideal >= {TARGET_IDEAL_RATIO}")
    return "\n".join(lines)


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
