"""``pipetransformer report``: plots and a markdown summary from run directories.

A run directory is what ``pipetransformer train`` leaves behind: ``config.yaml``, ``summary.json`` and
``metrics.jsonl`` (and ``test_samples.json`` when the run finished). The report puts several runs side by side so
a speed-up claim can be read off one page: throughput and layout over wall time, accuracy against wall time, where
each step's time goes, the wall-time speed-up of every run over the first one (the baseline), and the test metric's
difference to the baseline, paired sample by sample, with the error the test set's own sampling puts on it.

Time axis: step records carry a ``perf_counter`` timestamp taken at the end of the step; the origin is the
start of the first step (its timestamp minus its ``step_s``), which is also the origin of the eval records'
``wall_s`` (seconds since training started), so steps and evals share one axis.
"""

from __future__ import annotations

import json
import logging
import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pipetransformer.metrics import (
    CACHE_FIELD_PREFIX, LAYOUT_FIELDS, METRICS_FILE, NON_PHASE_SECONDS, TENSORBOARD_DIR_NAME, TEST_SAMPLES_FILE,
    eval_metric, tensorboard_available, tensorboard_scalars,
)

__all__ = [
    "RunDirError", "Run", "LayoutSegment", "REQUIRED_FILES", "PHASES", "OTHER_PHASE",
    "load_run", "run_labels", "speedup", "paired_test_difference", "seeds_difference", "combined_se",
    "layout_segments", "phase_means", "write_report", "write_tensorboard",
]

logger = logging.getLogger(__name__)

REQUIRED_FILES = ("config.yaml", "summary.json", METRICS_FILE)
REPORT_DIR_NAME = "report"
# Phase times the trainer may log per step (``<phase>_s``), in the order a step runs them.
PHASES = ("data", "forward", "backward", "forward_backward", "allreduce", "control", "optimizer")
OTHER_PHASE = "other"  # step time no named phase accounts for

ACCURACY_DIGITS = 4
SECONDS_DIGITS = 3
RATE_DIGITS = 2
RATIO_DIGITS = 3
MS_DIGITS = 1
MS_PER_S = 1000.0
FIGURE_DPI = 110
LINE_FIGSIZE = (8.0, 4.5)
PANEL_HEIGHT = 2.2
BAR_WIDTH_PER_SEGMENT = 1.1
MIN_BAR_FIGURE_WIDTH = 6.0
BAR_FIGURE_HEIGHT = 5.0
MARKER_SIZE = 3


class RunDirError(FileNotFoundError):
    """A directory that is not a complete run directory. A FileNotFoundError so that the CLI shows it as one
    line without a traceback."""


@dataclass(frozen=True)
class Run:
    """One run directory, read. ``steps`` are the step records with ``wall_s`` made relative to the start of
    training; ``evals`` keep the trainer's ``wall_s`` (already relative)."""

    path: Path
    name: str
    config: dict[str, Any]
    summary: dict[str, Any]
    steps: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    freezes: list[dict[str, Any]]
    test_samples: dict[str, Any] | None = None  # test_samples.json: the test metric per sample


@dataclass(frozen=True)
class LayoutSegment:
    """Consecutive logged steps under one layout, with their mean phase times in seconds."""

    frozen_layers: int
    stages: int
    dp_width: int
    micro_batches: int
    first_step: int
    last_step: int
    logged_steps: int
    phase_means: dict[str, float]

    def describe(self) -> str:
        return (f"frozen {self.frozen_layers}, {self.stages} stage(s) x dp {self.dp_width}, "
                f"{self.micro_batches} micro-batch(es)")


# --------------------------------------------------------------------------------------------- reading
def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise RunDirError(f"{path} is not valid JSON ({error.msg} at line {error.lineno}): "
                          f"re-run the training or pass another run directory") from error
    if not isinstance(value, dict):
        raise RunDirError(f"{path} holds no JSON object: pass a directory written by `pipetransformer train`")
    return value


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    """Records of the last run logged to ``path``. The trainer appends, so a run directory reused for a
    second run holds both; the summary describes the last, and so must the plots."""
    lines = path.read_text(encoding="utf-8").splitlines()
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if number == len(lines):  # a run killed while writing its last line: the rest is intact
                logger.warning("%s: ignoring a truncated last line", path)
                continue
            raise RunDirError(f"{path} line {number} is not valid JSON ({error.msg}): "
                              f"re-run the training or pass another run directory") from error
    starts = [i for i, r in enumerate(records) if r.get("event") == "step" and r.get("step") == 1]
    if len(starts) > 1:
        logger.warning("%s holds %d runs (the directory was reused); reporting the last", path, len(starts))
        records = records[starts[-1]:]
    return records


def _relative_steps(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not steps:
        return []
    origin = steps[0]["wall_s"] - steps[0].get("step_s", 0.0)
    return [{**s, "wall_s": s["wall_s"] - origin} for s in steps]


def load_run(path: Path) -> Run:
    """Read a run directory; a missing or unreadable file raises RunDirError naming it."""
    path = Path(path)
    if not path.is_dir():
        raise RunDirError(f"{path} is not a directory: pass run directories written by `pipetransformer train`")
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise RunDirError(f"{path} is not a run directory: missing {', '.join(missing)} "
                          f"(pass a directory written by `pipetransformer train`)")
    try:
        config = yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise RunDirError(f"{path / 'config.yaml'} is not valid YAML: pass another run directory") from error
    if not isinstance(config, dict):
        raise RunDirError(f"{path / 'config.yaml'} holds no config mapping: pass another run directory")
    summary = _read_json(path / "summary.json")
    records = _read_metrics(path / METRICS_FILE)
    name = (config.get("run") or {}).get("name") or path.name
    test_samples = _read_json(path / TEST_SAMPLES_FILE) if (path / TEST_SAMPLES_FILE).is_file() else None
    return Run(path=path, name=str(name), config=config, summary=summary,
               steps=_relative_steps([r for r in records if r.get("event") == "step"]),
               evals=[r for r in records if r.get("event") == "eval"],
               freezes=[r for r in records if r.get("event") == "freeze"], test_samples=test_samples)


def run_labels(runs: Sequence[Run]) -> list[str]:
    """Config names, disambiguated by directory name (then full path) when several runs share one."""
    labels = [run.name for run in runs]
    if len(set(labels)) < len(labels):
        labels = [f"{run.name} ({run.path.name})" for run in runs]
    if len(set(labels)) < len(labels):
        labels = [f"{run.name} ({run.path})" for run in runs]
    return labels


# --------------------------------------------------------------------------------------------- numbers
def speedup(baseline_wall_s: float, wall_s: float) -> float:
    """How many times faster than the baseline a run finished: >1 is faster."""
    if wall_s <= 0:
        raise ValueError(f"wall time must be positive, got {wall_s}: the run directory's summary is damaged")
    return baseline_wall_s / wall_s


def paired_test_difference(runs: Sequence[Sequence[float]], baselines: Sequence[Sequence[float]]
                           ) -> tuple[float, float | None]:
    """The mean test-metric difference of runs to their baselines (one per-sample list per seed, paired by
    position, all over the same test split in its order), and its standard error from the test set's sampling:
    the per-sample differences averaged over the seeds, their standard deviation over the root of the sample count.
    It is the error more seeds do not shrink (how far another test set of this size could move the difference);
    the seeds' own error comes on top."""
    if not runs or len(runs) != len(baselines):
        raise ValueError(f"pair each run with one baseline: got {len(runs)} runs and {len(baselines)} baselines")
    samples = len(runs[0])
    if any(len(values) != samples for values in (*runs, *baselines)) or samples == 0:
        raise ValueError("every run and baseline must score the same, non-empty test split")
    per_sample = [statistics.fmean(run[i] - base[i] for run, base in zip(runs, baselines)) for i in range(samples)]
    se = statistics.stdev(per_sample) / math.sqrt(samples) if samples > 1 else None
    return statistics.fmean(per_sample), se


def seeds_difference(per_seed: Sequence[float]) -> tuple[float, float]:
    """Mean of per-seed differences and its standard error over the seeds (0 with one seed)."""
    se = statistics.stdev(per_seed) / math.sqrt(len(per_seed)) if len(per_seed) > 1 else 0.0
    return statistics.fmean(per_seed), se


def combined_se(runs: Sequence[Sequence[float]], baselines: Sequence[Sequence[float]]) -> tuple[float, float]:
    """Mean paired difference and its standard error: the seeds' spread (:func:`seeds_difference`) and the test
    set's own sampling error (paired by row, :func:`paired_test_difference`) combined as a root sum of squares.
    Conservative: the seed-by-row interaction counts in both."""
    difference, row_se = paired_test_difference(runs, baselines)
    _, seed_se = seeds_difference([statistics.fmean(run) - statistics.fmean(base)
                                   for run, base in zip(runs, baselines)])
    return difference, math.hypot(seed_se, row_se or 0.0)


def _phase_names(steps: Sequence[dict[str, Any]]) -> list[str]:
    """The known phases first, then any other ``*_s`` field a newer trainer logs."""
    seen = {key[:-2] for s in steps for key in s
            if key.endswith("_s") and key not in NON_PHASE_SECONDS and not key.startswith(CACHE_FIELD_PREFIX)}
    return [p for p in PHASES if p in seen] + sorted(seen - set(PHASES))


def phase_means(steps: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds per phase over ``steps`` (a phase a step did not log counts 0), plus ``other``: the mean
    step time no phase accounts for, so the stack adds up to the mean step time."""
    if not steps:
        return {}
    names = _phase_names(steps)
    means = {p: sum(s.get(f"{p}_s", 0.0) for s in steps) / len(steps) for p in names}
    unaccounted = [s["step_s"] - sum(s.get(f"{p}_s", 0.0) for p in names) for s in steps if "step_s" in s]
    means[OTHER_PHASE] = max(0.0, sum(unaccounted) / len(unaccounted)) if unaccounted else 0.0
    return means


def _ordered_phases(means: Sequence[dict[str, float]]) -> list[str]:
    """The phases any of ``means`` has, in step order, ``other`` last."""
    present = {p for m in means for p in m}
    extra = sorted(present - {*PHASES, OTHER_PHASE})
    return [p for p in (*PHASES, *extra, OTHER_PHASE) if p in present]


def _layout_key(step: dict[str, Any]) -> tuple[int, ...]:
    return tuple(int(step.get(field, 0)) for field, _ in LAYOUT_FIELDS)


def layout_segments(steps: Sequence[dict[str, Any]]) -> list[LayoutSegment]:
    """Split the logged steps where the layout changes; each piece gets its own time breakdown."""
    groups: list[list[dict[str, Any]]] = []
    for step in steps:
        if groups and _layout_key(groups[-1][-1]) == _layout_key(step):
            groups[-1].append(step)
        else:
            groups.append([step])
    return [LayoutSegment(*_layout_key(g[0]), first_step=g[0]["step"], last_step=g[-1]["step"],
                          logged_steps=len(g), phase_means=phase_means(g)) for g in groups]


# --------------------------------------------------------------------------------------------- plots
def _save(figure: Figure, path: Path) -> None:
    FigureCanvasAgg(figure)
    figure.savefig(path, dpi=FIGURE_DPI)


def _finish_axes(axes: Axes, ylabel: str, has_lines: bool) -> None:
    axes.set_ylabel(ylabel)
    axes.grid(True, alpha=0.3)
    if has_lines:
        axes.legend(fontsize="small")
    else:
        axes.text(0.5, 0.5, "no data logged", ha="center", va="center", transform=axes.transAxes)


def _plot_throughput(runs: Sequence[Run], labels: Sequence[str], path: Path) -> None:
    figure = Figure(figsize=LINE_FIGSIZE, layout="constrained")
    axes = figure.add_subplot()
    drawn = False
    for run, label in zip(runs, labels):
        if run.steps:
            axes.plot([s["wall_s"] for s in run.steps], [s["samples_per_s"] for s in run.steps],
                      marker="o", markersize=MARKER_SIZE, label=label)
            drawn = True
    axes.set_title("Training throughput")
    axes.set_xlabel("wall time since training started (s)")
    _finish_axes(axes, "samples/s (per step)", drawn)
    _save(figure, path)


def _plot_layout(runs: Sequence[Run], labels: Sequence[str], path: Path) -> None:
    figure = Figure(figsize=(LINE_FIGSIZE[0], PANEL_HEIGHT * len(LAYOUT_FIELDS)), layout="constrained")
    panels = figure.subplots(len(LAYOUT_FIELDS), 1, sharex=True)
    for axes, (field, title) in zip(panels, LAYOUT_FIELDS):
        drawn = False
        for run, label in zip(runs, labels):
            if run.steps:
                # A step's value holds from the previous record to its own: "steps-pre", starting at 0.
                axes.plot([0.0] + [s["wall_s"] for s in run.steps],
                          [run.steps[0][field]] + [s[field] for s in run.steps], drawstyle="steps-pre", label=label)
                drawn = True
        axes.yaxis.get_major_locator().set_params(integer=True)
        _finish_axes(axes, title, drawn)
    panels[0].set_title("Layout over time")
    panels[-1].set_xlabel("wall time since training started (s)")
    _save(figure, path)


def _plot_accuracy(runs: Sequence[Run], labels: Sequence[str], path: Path) -> None:
    figure = Figure(figsize=LINE_FIGSIZE, layout="constrained")
    axes = figure.add_subplot()
    drawn = False
    metrics = sorted({eval_metric(run.evals) for run in runs if run.evals}) or [eval_metric([])]
    for run, label in zip(runs, labels):
        if run.evals:
            metric = eval_metric(run.evals)
            axes.plot([e["wall_s"] for e in run.evals], [e[metric] for e in run.evals], marker="o", label=label)
            drawn = True
    axes.set_title(f"Evaluation {' / '.join(metrics)}")
    axes.set_xlabel("wall time since training started (s)")
    _finish_axes(axes, " / ".join(metrics), drawn)
    _save(figure, path)


def _plot_breakdown(runs: Sequence[Run], labels: Sequence[str], path: Path) -> None:
    bars = []
    for run, label in zip(runs, labels):
        for seg in layout_segments(run.steps):
            layout = seg.describe().replace(", ", "\n")
            bars.append((f"{label}\n{layout}\nsteps {seg.first_step}-{seg.last_step}", seg.phase_means))
    phases = _ordered_phases([means for _, means in bars])
    width = max(MIN_BAR_FIGURE_WIDTH, BAR_WIDTH_PER_SEGMENT * len(bars) + MIN_BAR_FIGURE_WIDTH / 2)
    figure = Figure(figsize=(width, BAR_FIGURE_HEIGHT), layout="constrained")
    axes = figure.add_subplot()
    positions = list(range(len(bars)))
    bottoms = [0.0] * len(bars)
    for phase in phases:
        heights = [means.get(phase, 0.0) * MS_PER_S for _, means in bars]
        axes.bar(positions, heights, bottom=bottoms, label=phase)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    axes.set_xticks(positions, [label for label, _ in bars], fontsize="x-small")
    axes.set_title("Mean time per step, by phase (one bar per run and layout)")
    _finish_axes(axes, "ms per step", bool(bars))
    _save(figure, path)


# --------------------------------------------------------------------------------------------- markdown
def _number(value: float | None, digits: int) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines + [""]


def _automations(config: dict[str, Any]) -> str:
    def on(section: str) -> bool:
        return bool((config.get(section) or {}).get("enabled"))
    parts = []
    if on("freeze"):
        parts.append(f"freeze ({config['freeze'].get('policy')})")
    if on("pipe"):
        parts.append(f"pipe ({config['pipe'].get('schedule')})")
    if on("dp"):
        parts.append("dp")
    if on("cache"):
        parts.append("cache")
    return ", ".join(parts) or "none (plain training)"


def _run_section(run: Run, label: str) -> list[str]:
    s = run.summary
    transitions = s.get("transitions") or []
    decisions = s.get("freeze_decisions") or []
    moved_s = sum(t.get("seconds", 0.0) for t in transitions)
    metric = eval_metric(run.evals)
    lines = [f"## {label}", ""]
    lines += _table(["field", "value"], [
        ["config name", run.name],
        ["run directory", f"`{run.path}`"],
        ["automations", _automations(run.config)],
        ["world size", s.get("world_size", "n/a")],
        ["steps", s.get("steps", "n/a")],
        ["train samples", s.get("train_samples", "n/a")],
        [f"final validation {metric}", _number(s.get(f"eval_{metric}"), ACCURACY_DIGITS)],
        [f"best validation {metric}", _number(s.get(f"best_eval_{metric}"), ACCURACY_DIGITS)],
        [f"test {metric} (final model)", _number(s.get(f"test_{metric}"), ACCURACY_DIGITS)],
        [f"test {metric} at best validation", _number(s.get(f"test_{metric}_at_best_validation"), ACCURACY_DIGITS)],
        ["wall time (s)", _number(s.get("wall_time_s"), SECONDS_DIGITS)],
        ["samples/s", _number(s.get("samples_per_s"), RATE_DIGITS)],
        ["layout transitions", f"{len(transitions)} ({_number(moved_s, SECONDS_DIGITS)} s in total)"],
        ["freeze decisions", len(decisions)],
        ["freeze outcome", s.get("freeze_outcome", "n/a")],
    ])
    if transitions:
        lines += ["Layout transitions (after the given step):", ""]
        lines += _table(["step", "seconds", "blocks moved", "stages x dp", "micro-batches", "frozen blocks",
                         "cached blocks"],
                        [[t.get("step"), _number(t.get("seconds"), SECONDS_DIGITS), t.get("blocks_moved"),
                          f"{t.get('stages')} x {t.get('dp_width')}", t.get("micro_batches"), t.get("frozen_blocks"),
                          t.get("cached_blocks")] for t in transitions])
    if decisions:
        lines += ["Freeze decisions:", ""]
        lines += _table(["step", "epoch", "frozen layers"],
                        [[d.get("step"), d.get("epoch"), ", ".join(str(x) for x in d.get("frozen", [])) or "none"]
                         for d in decisions])
    segments = layout_segments(run.steps)
    if segments:
        phases = _ordered_phases([g.phase_means for g in segments])
        lines += ["Mean time per logged step (ms), by layout:", ""]
        lines += _table(["steps", "layout", *phases, "total"],
                        [[f"{g.first_step}-{g.last_step}", g.describe(),
                          *[_number(g.phase_means.get(p, 0.0) * MS_PER_S, MS_DIGITS) for p in phases],
                          _number(sum(g.phase_means.values()) * MS_PER_S, MS_DIGITS)] for g in segments])
    return lines


def _paired_test_cell(run: Run, baseline: Run) -> str:
    """``difference ± SE`` of the final models' test metric to the baseline's, sample by sample; ``n/a`` unless both
    runs recorded the same metric over test splits of one size."""
    mine, theirs = run.test_samples, baseline.test_samples
    if (mine is None or theirs is None or mine.get("metric") != theirs.get("metric")
            or len(mine["final"]) != len(theirs["final"])):
        return "n/a"
    difference, se = paired_test_difference([mine["final"]], [theirs["final"]])
    return f"{difference:+.{ACCURACY_DIGITS}f} ± {_number(se, ACCURACY_DIGITS)}"


def _comparison_section(runs: Sequence[Run], labels: Sequence[str]) -> list[str]:
    base = runs[0].summary
    lines = ["## Comparison", "",
             f"Baseline: the first run given, **{labels[0]}**. Speed-up = baseline wall time / run wall time "
             "(above 1: the run finished faster); samples/s ratio = run samples/s / baseline samples/s. Test vs "
             "baseline: the final model's test metric minus the baseline's, paired sample by sample, ± its standard "
             "error from the test set's sampling (the training seed's own noise is not in it: compare seeds for "
             "that).", ""]
    rows = []
    for run, label in zip(runs, labels):
        s = run.summary
        ratio = (s["samples_per_s"] / base["samples_per_s"]) if s.get("samples_per_s") and base.get("samples_per_s") \
            else None
        rows.append([label, _number(s["wall_time_s"], SECONDS_DIGITS),
                     _number(speedup(base["wall_time_s"], s["wall_time_s"]), RATIO_DIGITS),
                     _number(s.get("samples_per_s"), RATE_DIGITS), _number(ratio, RATIO_DIGITS),
                     s.get("train_samples", "n/a"),
                     _number(s.get(f"eval_{eval_metric(run.evals)}"), ACCURACY_DIGITS),
                     _paired_test_cell(run, runs[0])])
    metrics = " / ".join(sorted({eval_metric(run.evals) for run in runs}))
    lines += _table(["run", "wall time (s)", "speed-up", "samples/s", "samples/s ratio", "train samples",
                     f"final validation {metrics}", "test vs baseline (± test-set SE)"], rows)
    if len({run.summary.get("train_samples") for run in runs}) > 1:
        lines += ["Note: the runs trained on different numbers of samples, so their wall times do not measure the "
                  "same work; compare the samples/s ratio instead.", ""]
    return lines


def _markdown(runs: Sequence[Run], labels: Sequence[str], images: Sequence[tuple[str, str]],
              event_dirs: Sequence[Path]) -> str:
    lines = ["# PipeTransformer run report", ""]
    if len(runs) > 1:
        lines += _comparison_section(runs, labels)
    for run, label in zip(runs, labels):
        lines += _run_section(run, label)
    lines += ["## Plots", ""]
    for title, filename in images:
        lines += [f"### {title}", "", f"![{title}]({filename})", ""]
    if event_dirs:
        lines += ["TensorBoard event files (`tensorboard --logdir` a folder above them): "
                  + ", ".join(f"`{d}`" for d in event_dirs) + ".", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- entry points
def _safe_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_") or "run"


def write_report(run_dirs: list[Path], out: Path | None) -> Path:
    """Write the plots and ``report.md`` into ``out`` (default ``<first run dir>/report``); return ``out``."""
    if not run_dirs:
        raise ValueError("give at least one run directory")
    runs = [load_run(Path(d)) for d in run_dirs]
    for run in runs:
        if not isinstance(run.summary.get("wall_time_s"), (int, float)):
            raise RunDirError(f"{run.path / 'summary.json'} has no wall_time_s: pass a directory of a finished run")
    labels = run_labels(runs)
    out = Path(out) if out is not None else Path(run_dirs[0]) / REPORT_DIR_NAME
    out.mkdir(parents=True, exist_ok=True)
    images = [("Throughput", "throughput.png"), ("Layout", "layout.png"), ("Accuracy", "accuracy.png"),
              ("Time breakdown", "breakdown.png")]
    plots = (_plot_throughput, _plot_layout, _plot_accuracy, _plot_breakdown)
    for plot, (_, filename) in zip(plots, images):
        plot(runs, labels, out / filename)
    (out / "report.md").write_text(_markdown(runs, labels, images, _event_files(runs, labels, out)), encoding="utf-8")
    return out


def _event_files(runs: Sequence[Run], labels: Sequence[str], out: Path) -> list[Path]:
    """Each run's TensorBoard event directory: the one its training wrote live, or else a conversion of its
    ``metrics.jsonl`` into ``out`` (never both, so ``tensorboard --logdir runs`` shows every run once)."""
    found = []
    for run, label in zip(runs, labels):
        live = run.path / TENSORBOARD_DIR_NAME
        events = live if live.is_dir() else write_tensorboard(run.path, out / TENSORBOARD_DIR_NAME / _safe_name(label))
        if events is not None:
            found.append(events)
    return found


def write_tensorboard(run_dir: Path, out: Path) -> Path | None:
    """Convert a run's ``metrics.jsonl`` to TensorBoard event files in ``out`` (the scalars the trainer writes
    live, for runs made without them and for several runs side by side). Returns None, writing nothing, when
    the optional ``tensorboard`` package is not installed.

    Wall times are anchored so that TensorBoard's "relative" axis shows seconds since training started: the
    summary is written when training ends, so training started ``wall_time_s`` before its modification time.
    """
    if not tensorboard_available():
        return None
    from torch.utils.tensorboard import SummaryWriter

    run = load_run(Path(run_dir))
    started = (run.path / "summary.json").stat().st_mtime - float(run.summary.get("wall_time_s") or 0.0)
    writer = SummaryWriter(log_dir=str(out))
    try:
        for record in [*run.steps, *run.evals, *run.freezes]:
            when = started + record["wall_s"] if "wall_s" in record else None
            for tag, value in tensorboard_scalars(record):
                writer.add_scalar(tag, value, global_step=record["step"], walltime=when)
    finally:
        writer.close()
    return Path(out)
