"""The step simulator against this machine: predicted and measured step time and peak memory, per layout.

Every layout this machine runs (1 stage x 2 replicas, 2 stages x 1; 0..5 of MiniLM's 6 layers frozen; frozen
layers computed, their output being cached, or read from the cache; with and without recomputation) is
trained inside a few launches: ``freeze.policy: schedule`` freezes one more layer every two epochs of a small
training set, so each frozen count gets one epoch that fills the cache and one that reads it.

The ``local`` cluster is this machine as the planner sees it: block costs profiled by the same code the
trainer uses, the memory speed of the trainer's optimizer phase timed on the model's parameters, and two
constants fitted on two calibration launches (plain 1 x 2 and 2 x 1, no cache): the all-reduce bandwidth and the
cost of one micro-batch per stage. The other launches are the validation; only their errors count.

The simulator models compute, stage-to-stage messages, the gradient all-reduce and the optimizer step; data
loading and the per-step control all-reduce are not in it, so the prediction of a step is the simulated step
plus the calibration launches' median host time (``data_s + control_s``), against the measured ``step_s``.
Memory: each worker's peak resident memory against the memory it had before the model was built plus the
simulated peak of its stage. Last, the
shipped ``all`` run (the default freezer deciding when) is replayed: its layout history through the simulator,
plus profiling, transitions and evaluations, predicts its wall time.

    .venv/bin/python benchmarks/planner/local.py           # ~20 min: 7 launches on 2 workers
    .venv/bin/python benchmarks/planner/local.py --print   # the tables only, from the last launches' files
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import (  # noqa: E402 - the shared helper lives one folder up
    CONFIG_DIR,
    NPROC,
    REPO_ROOT,
    machine_info,
    markdown_table,
    replace_section,
    run_training,
    step_records,
)

import torch  # noqa: E402

from pipetransformer.config import Config, load_config  # noqa: E402
from pipetransformer.pipe.cost import BlockCost  # noqa: E402
from pipetransformer.pipe.partition import PartitionError  # noqa: E402
from pipetransformer.pipe.planner import plan_layout  # noqa: E402
from pipetransformer.pipe.profile import (  # noqa: E402
    PROFILE_BATCH,
    PROFILE_REPEATS,
    PROFILE_WARMUP,
    SMALL_BATCH_DIVISOR,
)
from pipetransformer.plan.cluster import Cluster, local_cluster  # noqa: E402
from pipetransformer.plan.command import optimizer_state_factor, profiled_costs  # noqa: E402
from pipetransformer.plan.levers import LeverSettings, simulate_layout  # noqa: E402
from pipetransformer.plan.simulate import optimizer_step_bytes  # noqa: E402

README = Path(__file__).resolve().parent / "README.md"
INDEX_LINE = "- This machine: `.venv/bin/python benchmarks/planner/local.py` (7 training launches, ~20 min)"
RUNS_DIR = REPO_ROOT / "runs" / "benchmarks" / "planner_local"
RESULTS = Path(__file__).resolve().parent / "results" / "local-results.json"
CONFIG = CONFIG_DIR / "text_minilm_ddp.yaml"
WORLD = 2
LAYERS = 6
EPOCHS_PER_FROZEN_COUNT = 2  # one fills the cache, one reads it
TRAIN_SAMPLES = 320  # 10 steps of 32 an epoch
MAX_LENGTH = 32  # most batches of 32 snippets reach it, so steps run at the profiled length
SETTLE_STEPS = 2  # steps after a freeze or an epoch start left out (layout hand-over, first shapes)
BUDGET_SHARE = 0.85  # the recomputation launches' memory budget: this share of the least one fitting without it
BUDGET_SEARCH_CEILING_GB, BUDGET_SEARCH_TOLERANCE_GB = 8.0, 1e-4
BANDWIDTHS_GB_S = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0)  # the calibration grid
OVERHEADS_MS = (0.0, 2.0, 5.0, 10.0, 20.0, 40.0)
OPTIMIZER_REPEATS = 5
UNCLIPPED_NORM_FACTOR = 10.0  # a gradient norm this many times train.grad_clip: the timed steps clip, as early steps do
STEP_GOAL, MEMORY_GOAL, WALL_GOAL = 0.15, 0.20, 0.15  # the error bounds

COMMON = (
    f"data.max_train_samples={TRAIN_SAMPLES}", "data.max_eval_samples=32", "data.max_test_samples=32",
    f"data.max_length={MAX_LENGTH}", f"train.epochs={EPOCHS_PER_FROZEN_COUNT * LAYERS}",
    "train.eval_every_steps=100000", "run.log_every=1", "pipe.enabled=true", "pipe.device_memory_gb=null",
    "dp.enabled=false", "freeze.enabled=true", "freeze.policy=schedule", "freeze.interval_unit=epochs",
    "freeze.prior=embeddings",  # auto until 2026-11-28, when it became a third of the layers
    "freeze.schedule=" + json.dumps([[EPOCHS_PER_FROZEN_COUNT * k, k] for k in range(1, LAYERS)]).replace(" ", ""),
)
ALL_CONFIG = CONFIG_DIR / "text_minilm_all.yaml"
ALL_COMMON = ("data.max_train_samples=2000", "data.max_eval_samples=600", "data.max_test_samples=32",
              f"data.max_length={MAX_LENGTH}", "train.epochs=3", "train.eval_every_steps=null")
"""The shipped ``all`` run at the freeze-transfer benchmark's Rotten Tomatoes size: the default freezer decides."""
ONE_STAGE = ("pipe.stages=1",)
TWO_STAGES = ("pipe.stages=2", "pipe.schedule=gpipe", "pipe.micro_batches=4")  # fixed, so recomputation must fit


@dataclass(frozen=True)
class Launch:
    name: str
    overrides: tuple[str, ...]
    calibration: bool = False
    recompute: bool = False
    config: Path = CONFIG
    common: tuple[str, ...] = COMMON
    replay: bool = False  # not a step-time point: its wall time is predicted from its freeze timeline


LAUNCHES = (
    Launch("1x2", (*ONE_STAGE, "cache.enabled=false"), calibration=True),
    Launch("2x1", (*TWO_STAGES, "cache.enabled=false"), calibration=True),
    Launch("1x2-cache", (*ONE_STAGE, "cache.enabled=true")),
    Launch("2x1-cache", (*TWO_STAGES, "cache.enabled=true")),
    Launch("1x2-recompute", (*ONE_STAGE, "cache.enabled=false"), recompute=True),
    Launch("2x1-recompute", (*TWO_STAGES, "cache.enabled=false"), recompute=True),
    Launch("all", (), config=ALL_CONFIG, common=ALL_COMMON, replay=True),
)


def _config(launch: Launch, extra: tuple[str, ...] = ()) -> Config:
    return load_config(launch.config, [*launch.common, *launch.overrides, *extra])


def _optimizer_bytes_per_s(config: Config) -> float:
    """The memory speed of the trainer's optimizer phase on this model's parameters (clipping, the update, clearing the
    gradients: :class:`HeldOptimizer` as the trainer builds it) with one worker's threads, as the simulator counts
    its bytes."""
    from pipetransformer.distributed import threads_of_one_worker
    from pipetransformer.models import build_model
    from pipetransformer.train.optimizer import HeldOptimizer

    model = build_model(config.model.kind, num_labels=2, path=config.model.path, hf_config=config.model.hf_config)
    optimizer = HeldOptimizer(model, config.train)
    optimizer.rebuild((0, len(model)), {})
    params = optimizer.params
    times = []
    with threads_of_one_worker(config.dist, NPROC):
        for _ in range(OPTIMIZER_REPEATS + 1):  # the first creates the state
            for p in params:
                p.grad = torch.randn_like(p)
            started = time.perf_counter()
            optimizer.step(config.train.lr, total_grad_norm=UNCLIPPED_NORM_FACTOR * (config.train.grad_clip or 1.0))
            times.append(time.perf_counter() - started)
    count = sum(p.numel() for p in params)
    factor = optimizer_state_factor(config.train.optimizer, config.train.momentum)
    return optimizer_step_bytes(count, factor) / statistics.median(times[1:])


def _cluster(memory_bytes_per_s: float, bandwidth_gb_s: float, overhead_ms: float) -> Cluster:
    cluster = local_cluster(WORLD, memory_gb=None, link_bandwidth_gb_s=bandwidth_gb_s, flops_per_second=float("inf"),
                            micro_batch_overhead_s=overhead_ms / 1e3)
    return replace(cluster, device=replace(cluster.device, memory_bytes_per_s=memory_bytes_per_s))


def measured_points(run_dir: Path, cache: bool) -> list[dict[str, Any]]:
    """Median measured seconds per (frozen layers, step kind), settled steps only. With the cache, the first epoch
    at a frozen count fills it ("fill": each sample's prefix advanced or computed once) and the second reads it
    ("cached"); without it, or before anything froze, steps are "plain"."""
    steps = step_records(run_dir)
    history = json.loads((run_dir / "summary.json").read_text())["layout_history"]
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    since: dict[tuple[int, int], int] = {}
    first_epoch: dict[int, int] = {}
    for record in steps:
        frozen, epoch = record["frozen_layers"], record["epoch"]
        first_epoch.setdefault(frozen, epoch)
        kind = "plain" if not cache or frozen == 0 else "fill" if epoch == first_epoch[frozen] else "cached"
        since[(frozen, epoch)] = since.get((frozen, epoch), 0) + 1
        if since[(frozen, epoch)] > SETTLE_STEPS:
            groups.setdefault((frozen, kind), []).append(record)
    points = []
    for (frozen, kind), group in sorted(groups.items()):
        layout = [h for h in history if h["frozen_layers"] <= frozen][-1]
        modelled = [r["step_s"] - r.get("data_s", 0.0) - r.get("control_s", 0.0) for r in group]
        points.append({"frozen_layers": frozen, "kind": kind, "steps": len(group), "layout": layout,
                       "measured_s": statistics.median(modelled),
                       "measured_full_s": statistics.median(r["step_s"] for r in group),
                       "host_s": statistics.median(r.get("data_s", 0.0) + r.get("control_s", 0.0) for r in group)})
    return points


def predicted(costs: list[BlockCost], cluster: Cluster, config: Config, point: dict[str, Any]) -> Any:
    layout = point["layout"]
    frozen_blocks = layout["frozen_blocks"]
    cached = {"cached": layout["cached_blocks"], "plain": 0}.get(point["kind"])
    if cached is None:  # filling: the previous boundary is read from the cache, the new layers run
        cached = point["previous_cached"]
    settings = LeverSettings(memory_budget_bytes=float("inf"), schedule=config.pipe.schedule,
                             optimizer_state_factor=optimizer_state_factor(config.train.optimizer,
                                                                           config.train.momentum),
                             touched_rows_only=config.dp.touched_rows_only)
    return simulate_layout(costs, cluster, settings, frozen_blocks=frozen_blocks, cached_blocks=cached,
                           bounds=[tuple(b) for b in layout["bounds"]], replicas=layout["dp_width"],
                           replica_batch=config.train.batch_size // layout["dp_width"],
                           micro_batches=layout["micro_batches"], recomputed=layout.get("recomputed_blocks", []))


def _with_previous_cache(points: list[dict[str, Any]]) -> None:
    """A filling step reads the boundary cached before this freeze (0 before the first)."""
    cached_before = 0
    for point in sorted(points, key=lambda p: (p["frozen_layers"], p["kind"] != "fill")):
        point["previous_cached"] = cached_before
        if point["kind"] == "cached":
            cached_before = point["layout"]["cached_blocks"]


def _errors(costs: list[BlockCost], cluster: Cluster, points: list[tuple[Config, dict[str, Any]]],
            host_s: float) -> list[float]:
    """Per point: (simulated step + host time) / measured step - 1."""
    return [(predicted(costs, cluster, config, point).step_s + host_s) / point["measured_full_s"] - 1
            for config, point in points]


def calibrate(costs: list[BlockCost], memory_bytes_per_s: float, points: list[tuple[Config, dict[str, Any]]],
              host_s: float) -> tuple[float, float]:
    """The (all-reduce GB/s, micro-batch ms) of the grid with the least median absolute error on ``points``."""
    def score(pair: tuple[float, float]) -> float:
        errors = _errors(costs, _cluster(memory_bytes_per_s, *pair), points, host_s)
        return statistics.median(abs(e) for e in errors)

    return min(itertools.product(BANDWIDTHS_GB_S, OVERHEADS_MS), key=score)


def recompute_budget_gb(costs: list[BlockCost], launch: Launch) -> float:
    """A share below the least budget the launch's layout fits without recomputation (any split of the blocks
    over its stages, found by bisection): only recomputation makes it fit."""
    def fits(budget_gb: float) -> bool:
        config = _config(launch, (f"pipe.device_memory_gb={budget_gb}",))
        try:
            plan_layout(config.pipe, costs, WORLD, elastic=False, batch_size=config.train.batch_size,
                        frozen_blocks=0, cached_blocks=0)
        except PartitionError:
            return False
        return True

    low, high = 0.0, BUDGET_SEARCH_CEILING_GB
    while high - low > BUDGET_SEARCH_TOLERANCE_GB:
        middle = (low + high) / 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    return round(BUDGET_SHARE * high, 4)


def run(runs_dir: Path) -> dict[str, Any]:
    """Profile, then every launch not yet finished in ``runs_dir`` (an interrupted benchmark goes on)."""
    path = runs_dir / "local.json"
    payload = json.loads(path.read_text()) if path.is_file() else {}
    if "costs" not in payload:
        config = _config(LAUNCHES[0])
        costs, _, names = profiled_costs(config, NPROC)  # with the threads each of the workers gets
        payload = {"machine": machine_info(), "costs": [c.__dict__ for c in costs], "block_names": names,
                   "optimizer_bytes_per_s": _optimizer_bytes_per_s(config), "launches": {}}
    costs = [BlockCost(**c) for c in payload["costs"]]
    for launch in LAUNCHES:
        if payload["launches"].get(launch.name, {}).get("ok"):
            continue
        extra: tuple[str, ...] = ()
        if launch.recompute:
            budget = recompute_budget_gb(costs, launch)
            extra = ("pipe.recompute=true", f"pipe.device_memory_gb={budget}")
        result = run_training(launch.name, launch.config, 0, runs_dir, [*launch.common, *launch.overrides, *extra])
        payload["launches"][launch.name] = {"overrides": [*launch.overrides, *extra], "run_dir": result.run_dir,
                                            "ok": result.ok, "error": result.error, "load_mean": result.load_mean,
                                            "load_max": result.load_max}
        path.write_text(json.dumps(payload, indent=1))
    return payload


def replay_wall_time(costs: list[BlockCost], cluster: Cluster, config: Config, summary: dict[str, Any], *,
                     host_s: float, transition_s: float) -> dict[str, float]:
    """A finished run's wall time predicted from its freeze timeline (``layout_history``): every step under its
    layout (after a freeze, one epoch of steps fills the cache, the later ones read it), plus the host time per
    step, the profile, the transitions and the evaluations. Measured: the run's ``wall_time_s``."""
    history = summary["layout_history"]
    steps_per_epoch = math.ceil(summary["train_samples"] / config.train.epochs / config.train.batch_size)
    seconds = {"steps": 0.0, "host": 0.0, "profile": 0.0, "transitions": 0.0, "evaluations": 0.0}
    for index, layout in enumerate(history):
        end = history[index + 1]["step"] if index + 1 < len(history) else summary["steps"]
        previous_cached = history[index - 1]["cached_blocks"] if index else 0
        for step in range(layout["step"] + 1, end + 1):
            filling = layout["cached_blocks"] and step - layout["step"] <= steps_per_epoch
            point = {"layout": layout, "kind": "fill" if filling else "cached" if layout["cached_blocks"] else "plain",
                     "previous_cached": previous_cached}
            seconds["steps"] += predicted(costs, cluster, config, point).step_s
            seconds["host"] += host_s
    # Profiling: warm-up and repeats, each a forward and a backward of every block and its frozen forward, at both
    # profiled sizes; every block above the first once more at the full size without its input's gradient.
    runs = PROFILE_WARMUP + PROFILE_REPEATS
    seconds["profile"] = runs * sum(sum(c.seconds(size)) + c.frozen_seconds(size) for c in costs
                                    for size in (PROFILE_BATCH, PROFILE_BATCH // SMALL_BATCH_DIVISOR))
    for cost in costs[1:]:
        forward, backward = cost.seconds(PROFILE_BATCH)
        seconds["profile"] += runs * (forward + backward * (1.0 - cost.input_grad_share))
    seconds["transitions"] = len(summary["transitions"]) * transition_s
    world = summary["world_size"]
    for evaluation in summary["eval_history"]:
        layout = [h for h in history if h["step"] <= evaluation["step"]][-1]
        per_sample = sum(c.frozen_forward[0] for c in costs[layout["cached_blocks"]:])  # eval mode, no graph
        seconds["evaluations"] += math.ceil(config.data.max_eval_samples / world) * per_sample
    predicted_s = sum(seconds.values())
    return {**seconds, "predicted_s": predicted_s, "measured_s": summary["wall_time_s"],
            "error": predicted_s / summary["wall_time_s"] - 1}


def analyse(payload: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    costs = [BlockCost(**c) for c in payload["costs"]]
    memory_bytes_per_s = payload["optimizer_bytes_per_s"]
    points: dict[str, list[tuple[Config, dict[str, Any]]]] = {}
    summaries, configs = {}, {}
    for launch in LAUNCHES:
        info = payload["launches"].get(launch.name, {"ok": False})
        if not info["ok"]:
            continue
        config = _config(launch, tuple(o for o in info["overrides"] if o not in launch.overrides))
        configs[launch.name] = config
        summaries[launch.name] = json.loads((Path(info["run_dir"]) / "summary.json").read_text())
        if launch.replay:
            continue
        measured = measured_points(Path(info["run_dir"]), cache="cache.enabled=true" in launch.overrides)
        _with_previous_cache(measured)
        points[launch.name] = [(config, point) for point in measured]
    calibration = [p for launch in LAUNCHES if launch.calibration for p in points.get(launch.name, [])]
    host_s = statistics.median(point["host_s"] for _, point in calibration)
    bandwidth, overhead = calibrate(costs, memory_bytes_per_s, calibration, host_s)
    cluster = _cluster(memory_bytes_per_s, bandwidth, overhead)
    transition_s = statistics.median(t["seconds"] for launch in LAUNCHES if launch.calibration
                                     for t in summaries.get(launch.name, {}).get("transitions", []))
    rows, errors, full_errors, memory_rows, memory_errors, training_ratios = [], [], [], [], [], []
    for launch in LAUNCHES:
        for config, point in points.get(launch.name, []):
            simulation = predicted(costs, cluster, config, point)
            error = simulation.step_s / point["measured_s"] - 1
            full_error = (simulation.step_s + host_s) / point["measured_full_s"] - 1
            if not launch.calibration:
                errors.append(error)
                full_errors.append(full_error)
            layout = point["layout"]
            rows.append([launch.name + (" (calibration)" if launch.calibration else ""), point["frozen_layers"],
                         point["kind"], f"{layout['stages']} x {layout['dp_width']}", layout["micro_batches"],
                         len(layout.get("recomputed_blocks", [])), point["steps"],
                         f"{point['measured_full_s'] * 1e3:.0f}", f"{(simulation.step_s + host_s) * 1e3:.0f}",
                         f"{full_error:+.0%}", f"{error:+.0%}"])
        summary = summaries.get(launch.name)
        if summary is None:
            continue
        first = summary["layout_history"][0]
        simulation = predicted(costs, cluster, configs[launch.name], {"layout": first, "kind": "plain"})
        for rank, (before, peak) in enumerate(zip(summary["rss_before_model_bytes"], summary["peak_rss_bytes"],
                                                  strict=True)):
            stage = rank % first["stages"]
            expected = before + simulation.stage_memory_bytes[stage]
            error = expected / peak - 1
            memory_errors.append(error)
            training_ratio = (peak - before) / simulation.stage_memory_bytes[stage]
            training_ratios.append(training_ratio)
            memory_rows.append([launch.name, rank, stage, f"{before / 2**20:.0f}",
                                f"{simulation.stage_memory_bytes[stage] / 2**20:.0f}", f"{expected / 2**20:.0f}",
                                f"{peak / 2**20:.0f}", f"{error:+.0%}", f"{training_ratio:.2f}"])
    replays = {launch.name: replay_wall_time(costs, cluster, configs[launch.name], summaries[launch.name],
                                             host_s=host_s, transition_s=transition_s)
               for launch in LAUNCHES if launch.replay and launch.name in summaries}
    median_error = statistics.median(abs(e) for e in errors) if errors else None
    median_full = statistics.median(abs(e) for e in full_errors) if full_errors else None
    median_memory = statistics.median(abs(e) for e in memory_errors) if memory_errors else None
    machine = payload["machine"]
    lines = [
        "## This machine: predicted against measured",
        "",
        f"`.venv/bin/python benchmarks/planner/local.py` on {machine['nproc']} cores, torch {machine['torch']}, "
        f"started {machine['started']} (load {machine['load_average_at_start'][0]}): MiniLM-L6 on "
        f"{TRAIN_SAMPLES} Rotten Tomatoes snippets at {MAX_LENGTH} tokens, batch 32, one more layer frozen every "
        f"{EPOCHS_PER_FROZEN_COUNT} epochs; mean load during the launches "
        + ", ".join(f"{name} {info['load_mean']:.1f}" for name, info in payload["launches"].items()
                    if info["load_mean"] is not None) + ".",
        "",
        f"Local profile: block costs profiled at batches {PROFILE_BATCH} and {PROFILE_BATCH // SMALL_BATCH_DIVISOR} "
        f"(per sample and per call) with the threads one of {NPROC} workers gets; the optimizer's memory speed timed "
        f"({memory_bytes_per_s / 1e9:.1f} GB/s); fitted on the calibration launches: all-reduce bandwidth "
        f"{bandwidth} GB/s and {overhead} ms per micro-batch per stage (grid {BANDWIDTHS_GB_S} GB/s x "
        f"{OVERHEADS_MS} ms). Data loading and the control all-reduce (median {host_s * 1e3:.0f} ms a step on "
        "the calibration launches) are outside the simulator.",
        "",
        f"**Step time, validation launches: median absolute error {_pct(median_full)}** (goal {STEP_GOAL:.0%}): "
        "the simulated step plus the calibration launches' host time against the measured `step_s`. Against "
        f"the simulated part alone (`step_s - data_s - control_s`): {_pct(median_error)}; that split is not "
        "clean in a pipeline, where the control all-reduce also absorbs a stage's wait for the slower one.",
        f"**Peak memory per worker: median absolute error {_pct(median_memory)}** (goal {MEMORY_GOAL:.0%}). That "
        "error is diluted by the runtime and data every worker holds before the model is built (~460 MiB here): "
        "what the model adds, peak minus that, is "
        f"{min(training_ratios):.2f}-{max(training_ratios):.2f}x the simulated stage (median "
        f"{statistics.median(training_ratios):.2f}x): the simulator counts a stage's training state, while a "
        "worker's peak also holds what it does besides (the whole model on every rank for evaluation, the "
        "evaluation batches, rank 0's profile, allocator caching).",
        "",
        markdown_table(["launch", "frozen", "steps are", "layout", "M", "recomputed", "steps", "measured step ms",
                        "predicted ms", "error", "simulated-part error"], rows),
        "",
        "Memory: each worker's peak resident memory against its memory before the model was built plus its "
        "stage's simulated peak at the launch's first layout (0 frozen: the most it trains).",
        "",
        markdown_table(["launch", "rank", "stage", "before model MiB", "simulated MiB", "predicted MiB",
                        "measured peak MiB", "error", "(peak - before) / simulated"], memory_rows),
    ]
    for name, replay in replays.items():
        parts = ", ".join(f"{key} {replay[key]:.1f}" for key in ("steps", "host", "profile", "transitions",
                                                               "evaluations"))
        lines += ["", f"**Replay of `{name}`** (the shipped `text_minilm_all.yaml`, the default freezer deciding; "
                      f"{', '.join(ALL_COMMON)}): its layout history through the simulator predicts "
                      f"{replay['predicted_s']:.0f} s ({parts}) against a measured wall time of "
                      f"{replay['measured_s']:.0f} s: **{replay['error']:+.1%}** (goal {WALL_GOAL:.0%}); "
                      f"per-transition time {transition_s:.2f} s and host time per step from the calibration "
                      "launches."]
    results = {"bandwidth_gb_s": bandwidth, "micro_batch_overhead_ms": overhead, "host_s": host_s,
               "median_step_error": median_error, "median_full_step_error": median_full,
               "median_memory_error": median_memory, "training_memory_ratios": training_ratios, "rows": rows,
               "memory_rows": memory_rows,
               "transition_s": transition_s, "replays": replays}
    return "\n".join(lines), results


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--print", action="store_true", help="analyse the last launches and print, run nothing")
    parser.add_argument("--runs-dir", type=Path, default=RUNS_DIR)
    args = parser.parse_args()
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    payload = (json.loads((args.runs_dir / "local.json").read_text()) if args.print else run(args.runs_dir))
    body, results = analyse(payload)
    (args.runs_dir / "local-results.json").write_text(json.dumps(results, indent=1))
    if not args.print:  # every launch and the analysis, kept with the README
        RESULTS.write_text(json.dumps({"launches_and_profile": payload, "analysis": results}, indent=1))
    if args.print:
        print(body)
    else:
        replace_section(README, "local", body, INDEX_LINE)
        print(body)


if __name__ == "__main__":
    main()
