"""``pipetransformer plan``: what AutoPipe would do for a config, without training.

Builds the model, profiles its blocks on this machine (or uses the analytical model when
``pipe.profile: false``), and prints the per-block costs, the chosen partition, stage costs, the
predicted bubble and step time.

With ``--cluster`` it predicts a whole run instead, on a cluster preset or description (or ``local``,
this machine as profiled): the layout at every phase of a freeze timeline, chosen among more stages,
recomputation and bf16 (:mod:`pipetransformer.plan.levers`), each phase's step simulated
(:mod:`pipetransformer.plan.simulate`), the alternatives rejected and why, and the speed-up over the
static Pipe+DDP baseline.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipetransformer.config import LANGUAGE_MODEL_KINDS, Config, ConfigError
from pipetransformer.dp.batch import KEEP_PER_PIPELINE
from pipetransformer.pipe.cost import (
    ADAMW_STATE_FACTOR,
    FLOAT_BYTES,
    SGD_MOMENTUM_STATE_FACTOR,
    BlockCost,
    BlockWork,
    Precision,
)
from pipetransformer.pipe.partition import GIB, bubble_fraction, predict_step_time
from pipetransformer.pipe.planner import PER_MICROBATCH_OVERHEAD_S, LayoutPlan, block_states, plan_request
from pipetransformer.plan.cluster import LOCAL, Cluster, calibrated_flops, load_cluster, local_cluster
from pipetransformer.plan.levers import Candidate, LeverSettings
from pipetransformer.plan.model_spec import BUILT_IN_MODELS, ModelSpec, load_model_spec, model_from_hf_config
from pipetransformer.plan.runplan import BatchPolicy, FreezePoint, RunPlan, geometric_timeline, plan_run, read_timeline

__all__ = ["ClusterPlanRequest", "check_before_workers", "cluster_plan_command", "cluster_run_plan",
           "plan_command", "plan_report", "profiled_costs"]


def _model_and_batch(config: Config, device: Any = "cpu") -> tuple[Any, tuple[Any, ...], int]:
    """The config's model (blocks, on ``device``), one example batch there, and its class count: what profiling
    runs on. Data and models the trainer would refuse raise the trainer's :class:`ConfigError`."""
    import torch

    from pipetransformer.pipe.profile import PROFILE_BATCH
    from pipetransformer.train.build import build_blocks, check_data_fits_model, example_inputs, read_splits

    train = read_splits(replace(config, data=replace(config.data, max_train_samples=PROFILE_BATCH))).train
    model = build_blocks(config, train.num_classes, torch.device(device))  # profiled as it will train
    check_data_fits_model(config, model, train)
    return model, example_inputs(train, config.data.max_length, torch.device(device), PROFILE_BATCH), train.num_classes


def profiled_costs(config: Config, local_workers: int) -> tuple[list[BlockCost], list[BlockWork], list[str]]:
    """Measured (or, with ``pipe.profile: false``, estimated) costs and the analytic work of the config's model,
    measured with the threads one of ``local_workers`` workers on this machine gets: a block on 2 threads runs
    faster per sample than on the 1 a worker of two has, and the plan would be for a machine the run is not.
    On the device the workers will use (the first CUDA device when ``dist.device`` resolves to cuda), as they do."""
    from pipetransformer.distributed import resolve_device, threads_of_one_worker
    from pipetransformer.pipe.profile import analytic_block_work, estimate_block_costs

    model, inputs, num_classes = _model_and_batch(config, resolve_device(config.dist))
    with threads_of_one_worker(config.dist, local_workers):
        costs = estimate_block_costs(model, inputs, num_classes=num_classes, measure=config.pipe.profile)
    return costs, analytic_block_work(model, inputs, num_classes=num_classes), model.block_names()


def check_before_workers(config: Config, world_size: int) -> None:
    """Raise, before any worker starts, the errors the workers would meet first: a device or backend this machine
    lacks, data that cannot be read, a model that cannot be split into blocks, and (with ``pipe.device_memory_gb``)
    no layout of the untrained model fitting the budget on ``world_size`` workers (the trainer's
    :class:`~pipetransformer.pipe.partition.PartitionError`).

    Whether a layout fits reads only the blocks' bytes (parameters, saved activations, outputs), which one
    untimed-repeat profile of the example batch measures as the workers' full profile does. Freezing only frees
    memory, so the layout at the start is the one that must fit; a run resuming from a checkpoint, which may hold
    frozen layers, is not checked for it, nor is a CUDA run, whose kernels save other activations than the CPU's
    (the launcher keeps off the devices its workers will use).
    """
    from pipetransformer.distributed import check_device_settings, wants_cuda
    from pipetransformer.pipe.profile import estimate_block_costs, profile_blocks

    check_device_settings(config.dist)
    model, inputs, num_classes = _model_and_batch(config)
    if (not config.pipe.enabled or config.pipe.device_memory_gb is None or config.checkpoint.resume is not None
            or wants_cuda(config.dist)):
        return
    costs = (profile_blocks(model, inputs, warmup=0, repeats=1) if config.pipe.profile
             else estimate_block_costs(model, inputs, num_classes=num_classes, measure=False))
    _layout(config, world_size, costs)


def _layout(config: Config, world_size: int, costs: list[BlockCost], frozen_blocks: int = 0,
            cached_blocks: int = 0) -> LayoutPlan:
    """AutoPipe's layout of ``config`` on ``world_size`` workers for a freeze state, as the trainer plans it."""
    request = plan_request(config.pipe, config.dp, config.train.batch_size, Precision(config.train.precision))
    return request.plan(costs, world_size, frozen_blocks=frozen_blocks, cached_blocks=cached_blocks)


def plan_report(config: Config, world_size: int, costs: list[BlockCost], names: list[str],
                frozen_blocks: int = 0, cached_blocks: int = 0) -> dict[str, Any]:
    plan = _layout(config, world_size, costs, frozen_blocks, cached_blocks)
    per_replica = max(1, config.train.batch_size // plan.layout.dp_width)
    states = block_states(len(costs), frozen_blocks, cached_blocks)
    return {
        "world_size": world_size,
        "blocks": [{"name": n, "state": s.value, "forward_ms_per_sample": c.forward_s * 1e3,
                    "backward_ms_per_sample": c.backward_s * 1e3, "forward_ms_per_call": c.forward_fixed_s * 1e3,
                    "backward_ms_per_call": c.backward_fixed_s * 1e3,
                    "frozen_forward_ms_per_sample": c.frozen_forward[0] * 1e3,
                    "frozen_forward_ms_per_call": c.frozen_forward[1] * 1e3, "output_bytes": c.output_bytes,
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
    costs, _, names = profiled_costs(config, world_size)
    report = plan_report(config, world_size, costs, names)
    if as_json:
        print(json.dumps(report, indent=2))
        return 0
    print("per sample (ms/s) and per call, whatever its size (ms/call); frozen: the forward of the block frozen:")
    print(f"{'block':<12} {'fwd ms/s':>9} {'bwd ms/s':>9} {'fwd ms/call':>12} {'bwd ms/call':>12} "
          f"{'frozen ms/s':>12} {'out KB':>8} {'param MB':>9} {'act KB':>8}")
    for b in report["blocks"]:
        print(f"{b['name']:<12} {b['forward_ms_per_sample']:>9.3f} {b['backward_ms_per_sample']:>9.3f} "
              f"{b['forward_ms_per_call']:>12.3f} {b['backward_ms_per_call']:>12.3f} "
              f"{b['frozen_forward_ms_per_sample']:>12.3f} "
              f"{b['output_bytes'] / 1e3:>8.1f} {b['param_bytes'] / 1e6:>9.2f} {b['activation_bytes'] / 1e3:>8.1f}")
    print(f"\nworkers {world_size}: {report['stages']} stage(s) x {report['dp_width']} replica(s), "
          f"{report['micro_batches']} micro-batch(es)"
          + (f", recomputing blocks {', '.join(map(str, report['recomputed_blocks']))}"
             if report["recomputed_blocks"] else ""))
    for i, ((start, end), ms, mem) in enumerate(zip(report["bounds"], report["stage_ms"],
                                                    report["stage_memory_bytes"], strict=True)):
        print(f"  stage {i}: blocks {start}..{end - 1}  {ms:.1f} ms per {report['stage_ms_samples']} samples  "
              f"{mem / 1e6:.1f} MB")
    bubble = report["bubble_fraction"]
    print(f"bubble {bubble:.1%}, predicted step {report['predicted_step_s'] * 1e3:.0f} ms"
          + ("" if math.isfinite(report["predicted_step_s"]) else " (unbounded)"))
    return 0


# --------------------------------------------------------------------------- plan --cluster: a whole run, predicted

LEVERS = ("stages", "recompute", "bf16")
GEOMETRIC = "geometric"
PLOT_DPI = 120


@dataclass(frozen=True)
class ClusterPlanRequest:
    """The ``plan --cluster`` options (see ``pipetransformer plan --help``)."""

    cluster: str
    model: str | None = None
    seq_len: int | None = None
    freeze: str = GEOMETRIC
    epochs: float | None = None
    freeze_every: float | None = None
    levers: tuple[str, ...] = LEVERS
    baseline_stages: int | None = None
    baseline_micro_batches: int | None = None
    plot: str | None = None
    timeline: bool = False


def optimizer_state_factor(optimizer: str, momentum: float) -> int:
    """Parameter-sized state tensors the optimizer keeps: AdamW two, SGD one with momentum, none without."""
    if optimizer == "adamw":
        return ADAMW_STATE_FACTOR
    return SGD_MOMENTUM_STATE_FACTOR if momentum else 0


def _spec_from_config(config: Config) -> ModelSpec:
    """The analytic description of the model a config trains (for a cluster this machine is not)."""
    model = config.model
    if model.kind in LANGUAGE_MODEL_KINDS:
        raise ConfigError(f"the planner models encoders and ViTs: a decoder (model.kind: {model.kind}) has no cluster "
                          "model yet; train it here with pipetransformer train")
    if model.kind == "minilm":
        return BUILT_IN_MODELS["minilm"].with_seq_len(config.data.max_length)
    if model.kind == "vit":
        vit = dict(model.vit)
        hf = {"model_type": "vit", "image_size": vit["image_size"], "patch_size": vit["patch_size"],
              "num_channels": vit["in_channels"], "hidden_size": vit["dim"], "num_hidden_layers": vit["depth"],
              "num_attention_heads": vit["heads"], "intermediate_size": math.ceil(vit["mlp_ratio"] * vit["dim"])}
        return model_from_hf_config(hf, name="vit (config)")
    spec = (load_model_spec(model.path) if model.path
            else model_from_hf_config(model.hf_config or {}, name="model.hf_config"))
    return spec.with_seq_len(config.data.max_length) if spec.is_text else spec


def _levers(names: tuple[str, ...]) -> tuple[str, ...]:
    unknown = [name for name in names if name not in LEVERS]
    if unknown:
        raise ConfigError(f"--levers: unknown lever {unknown[0]!r} (allowed: {', '.join(LEVERS)})")
    return names


def _timeline(config: Config, request: ClusterPlanRequest, num_layers: int, epochs: float) -> list[FreezePoint]:
    if request.freeze != GEOMETRIC:
        return read_timeline(Path(request.freeze))
    every = request.freeze_every
    if every is None:
        if config.freeze.interval_unit == "steps":
            raise ConfigError("freeze.interval_unit is steps, which the planner cannot place in epochs: "
                              "give --freeze-every EPOCHS")
        every = float(config.freeze.interval) * (epochs if config.freeze.interval_unit == "fraction" else 1.0)
    return geometric_timeline(num_layers, alpha=config.freeze.alpha, max_fraction=config.freeze.max_fraction,
                              epochs=epochs, every_epochs=every)


def cluster_run_plan(config: Config, request: ClusterPlanRequest,
                     world_size: int) -> tuple[RunPlan, Cluster, ModelSpec | None, LeverSettings]:
    """The predicted run of ``config`` (or of ``request.model``) on ``request.cluster``."""
    levers = _levers(request.levers)
    spec = load_model_spec(request.model, seq_len=request.seq_len) if request.model is not None else None
    costs: dict[Precision, list[BlockCost] | None]
    if request.cluster == LOCAL:
        measured, work, _ = profiled_costs(config, world_size)
        cluster = local_cluster(world_size, memory_gb=config.pipe.device_memory_gb,
                                link_bandwidth_gb_s=config.pipe.link_bandwidth_gbps,
                                flops_per_second=calibrated_flops(work, measured),
                                micro_batch_overhead_s=PER_MICROBATCH_OVERHEAD_S)
        costs = {Precision.FP32: measured, Precision.BF16: None}
    else:
        cluster = load_cluster(request.cluster)
        spec = spec or _spec_from_config(config)
    if spec is not None:  # analytic costs at the cluster's (for local: the calibrated) speed
        costs = {precision: spec.costs(cluster.device, precision) for precision in Precision}
    fp32 = costs[Precision.FP32]
    assert fp32 is not None
    num_layers = len(fp32) - 2
    budget = config.pipe.memory_budget_bytes(cluster.device.memory_bytes)
    fixed_stages = (config.pipe.stages,) if isinstance(config.pipe.stages, int) else (1,)
    micro_batches = config.pipe.micro_batches if isinstance(config.pipe.micro_batches, int) else None
    settings = LeverSettings(
        memory_budget_bytes=budget, schedule=config.pipe.schedule, micro_batches=micro_batches,
        precisions=(Precision.FP32, Precision.BF16) if "bf16" in levers else (Precision.FP32,),
        recompute="recompute" in levers, stage_counts=None if "stages" in levers else fixed_stages,
        optimizer_state_factor=optimizer_state_factor(config.train.optimizer, config.train.momentum),
        touched_rows_only=config.dp.touched_rows_only)
    baseline = replace(settings, precisions=(Precision.FP32,), recompute=False, touched_rows_only=False,  # as DDP
                       stage_counts=None if request.baseline_stages is None else (request.baseline_stages,),
                       micro_batches=request.baseline_micro_batches or micro_batches)
    epochs = request.epochs if request.epochs is not None else float(config.train.epochs)
    plan = plan_run(costs, cluster, num_layers=num_layers, timeline=_timeline(config, request, num_layers, epochs),
                    epochs=epochs, settings=settings, baseline_settings=baseline,
                    batch=BatchPolicy(config.train.batch_size, config.dp.batch_policy == KEEP_PER_PIPELINE),
                    cache=config.cache.enabled, cache_min_frozen=config.cache.min_frozen)
    return plan, cluster, spec, settings


def _model_lines(spec: ModelSpec, optimizer_factor: int) -> list[str]:
    """Embeddings, one layer (all are alike), head: per-sample FLOPs and bytes, per-block weights."""
    rows = spec.describe_blocks(Precision.FP32, optimizer_factor)
    shown = [rows[0], rows[1], rows[-1]]
    params = sum(row["param_bytes"] for row in rows) / FLOAT_BYTES
    lines = [f"model {spec.name}: {spec.num_layers} layers, hidden {spec.hidden_size}, {spec.seq_len} tokens, "
             f"{params / 1e6:.1f} M parameters (fp32; bf16 halves activations and outputs)",
             f"  {'block':<12} {'GFLOP/sample':>12} {'param MB':>9} {'grad+opt MB':>11} {'act MB/sample':>13} "
             f"{'out KB/sample':>13}"]
    for row in shown:
        name = row["name"] if row["name"] != "layer_0" else f"layer (x{spec.num_layers})"
        lines.append(f"  {name:<12} {row['forward_gflops']:>12.3f} {row['param_bytes'] / 1e6:>9.1f} "
                     f"{(row['gradient_bytes'] + row['optimizer_bytes']) / 1e6:>11.1f} "
                     f"{row['activation_bytes'] / 1e6:>13.2f} {row['output_bytes'] / 1e3:>13.1f}")
    return lines


def _phase_row(start: float, end: float, frozen: str, cached: str, candidate: Candidate) -> str:
    simulation = candidate.simulation
    assert simulation is not None
    recompute = str(len(candidate.recomputed)) if candidate.recomputed else "-"
    return (f"  {start:>5.2f} {end:>5.2f} {frozen:>6} {cached:>6}  {candidate.stages:>2} x {candidate.replicas:<3}"
            f" {candidate.micro_batches:>4} {candidate.replica_batch:>5} {candidate.precision.value:>5} {recompute:>9}"
            f" {candidate.samples_per_s:>10.1f} {simulation.step_s * 1e3:>8.1f} {simulation.bubble_fraction:>6.2f}"
            f" {candidate.peak_memory_bytes / GIB:>7.2f}")


def format_run_plan(plan: RunPlan, cluster: Cluster, spec: ModelSpec | None, settings: LeverSettings,
                    show_timeline: bool) -> str:
    lines = [f"cluster {cluster.describe()}"]
    if spec is not None:
        lines += _model_lines(spec, settings.optimizer_state_factor)
    levers = ["stages" if settings.stage_counts is None else f"stages fixed at {settings.stage_counts[0]}"]
    levers += ["recomputation"] if settings.recompute else []
    levers += ["bf16"] if Precision.BF16 in settings.precisions else []
    lines.append(f"levers: {', '.join(levers)}; budget {settings.memory_budget_bytes / GIB:.2f} GiB per device; "
                 f"{settings.schedule}")
    lines += ["", f"  {'from':>5} {'to':>5} {'frozen':>6} {'cached':>6}  {'layout':<8} {'M':>4} {'batch':>5} "
                  f"{'prec':>5} {'recompute':>9} {'samples/s':>10} {'step ms':>8} {'bubble':>6} {'mem GiB':>7}"]
    for phase in plan.phases:
        frozen = f"{phase.frozen_layers}" + ("*" if phase.filling else "")
        lines.append(_phase_row(phase.start, phase.end, frozen, str(phase.cached_blocks), phase.choice.chosen))
    lines.append(_phase_row(0.0, 1.0, "-", "-", plan.baseline.chosen) + "  <- static Pipe+DDP baseline")
    lines += ["  (from/to: fraction of the run's samples; frozen: layers, * = the cache's first epoch after a freeze;"
              " cached: blocks; batch: per replica; mem: fullest device)",
              f"predicted speed-up over the baseline: {plan.speedup:.2f}x "
              f"({1 / plan.relative_time:.0f} vs {plan.baseline.chosen.samples_per_s:.0f} samples/s on average)",
              "", "rejected alternatives:"]
    for phase in plan.phases:
        lines.append(f"  {phase.start:.2f}-{phase.end:.2f} ({phase.frozen_layers} frozen): chose "
                     f"{phase.choice.chosen.label()}")
        lines += [f"    {candidate.label()}: {candidate.reason}" for candidate in phase.choice.rejected]
    if show_timeline:
        for phase in plan.phases:
            simulation = phase.choice.chosen.simulation
            assert simulation is not None
            lines += ["", f"one step at {phase.start:.2f}-{phase.end:.2f} ({simulation.step_s * 1e3:.1f} ms):",
                      simulation.render()]
    return "\n".join(lines)


def plot_run_plan(plan: RunPlan, path: Path) -> None:
    """Predicted samples/s through the run, PipeTransformer against the static baseline."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 4))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for phase in plan.phases:
        chosen = phase.choice.chosen
        axes.hlines(phase.samples_per_s, phase.start, phase.end, colors="tab:blue", linewidth=2)
        axes.annotate(f"{chosen.stages}x{chosen.replicas}", ((phase.start + phase.end) / 2, phase.samples_per_s),
                      textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
    axes.hlines(plan.baseline.chosen.samples_per_s, 0, 1, colors="tab:gray", linestyles="dashed",
                label=f"static Pipe+DDP ({plan.baseline.chosen.label()})")
    axes.plot([], [], color="tab:blue", label=f"PipeTransformer (predicted {plan.speedup:.2f}x)")
    axes.set_xlabel("fraction of the run's samples")
    axes.set_ylabel("predicted samples/s")
    axes.legend(loc="upper left", fontsize=8)
    figure.savefig(path, dpi=PLOT_DPI, bbox_inches="tight")


def cluster_plan_command(config: Config, request: ClusterPlanRequest, world_size: int, as_json: bool) -> int:
    plan, cluster, spec, settings = cluster_run_plan(config, request, world_size)
    if request.plot:
        plot_run_plan(plan, Path(request.plot))
    if as_json:
        print(json.dumps({"cluster": cluster.name, "model": spec.name if spec else config.model.kind,
                          **plan.describe()}, indent=2))
    else:
        print(format_run_plan(plan, cluster, spec, settings, request.timeline))
    return 0
