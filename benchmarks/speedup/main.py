"""End-to-end speed-up of PipeTransformer over its baselines (the paper's Table 1 / Figure 9), on 2 workers.

One command per table::

    .venv/bin/python benchmarks/speedup/main.py --quick --task text
    .venv/bin/python benchmarks/speedup/main.py --task both --repeats 3

Runs the config family of a task (``ddp``, ``no_freeze``, ``freeze_only``, ``freeze_pipe_cache``,
``freeze_pipe_dp``, ``all``) and ``single`` (the ``ddp`` config in one process using every core, the other
plain baseline a user would pick) with the same seed and epochs, repeats interleaved (the order rotates each
repeat), and writes ``results/results-<task>.md`` / ``.json`` (``quick-`` before, the configs after
when a quick run or a subset of the family ran, so those never overwrite a full run's files), plus
``pipetransformer report`` plots of the ``all`` run against the baselines, and puts the run's table in
benchmarks/README.md under its own marker, keeping the section's hand-written history. For the text task it
also measures the plain-PyTorch DDP reference (``reference_ddp.py``), so the ``ddp`` baseline can be checked
against what a user gets without this project.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pipetransformer.metrics import TEST_SAMPLES_FILE
from pipetransformer.report import combined_se

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import (  # noqa: E402 - the shared helper lives one folder up
    DISTURBED_LOAD,
    NPROC,
    REPO_ROOT,
    TASKS,
    LoadSampler,
    Member,
    RunResult,
    TaskSpec,
    ensure_backbone,
    fmnist_folder,
    fmt,
    interleaved_order,
    machine_info,
    markdown_table,
    median,
    replace_block,
    run_training,
    step_breakdown,
    write_results,
)

__all__ = ["FAMILY", "main"]

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
"""Where every run writes its tables, records and plots."""
DEFAULT_RUNS_DIR = REPO_ROOT / "runs" / "benchmarks" / "speedup"
FAMILY = ("single", "ddp", "no_freeze", "freeze_only", "freeze_pipe_cache", "freeze_pipe_dp", "all")
PLAIN_BASELINES = ("ddp", "single")
"""What a user would run without this project; speed-ups count against the faster of them."""
PAPER_BASELINE = "no_freeze"  # the paper's Pipe+DDP: a static pipeline the memory budget forces
VARIANTS = {"single": Member("ddp", nproc=1)}  # one process, every core (threads default to cores / workers)
"""Members that run another member's config; every other member runs its own on ``NPROC`` workers."""
REPORTED = ("all", "no_freeze", "ddp")  # runs the report plots put side by side; the first is the reference
REPORT_PNG = "throughput.png"
README_ANCHOR = "<!-- speedup:newest -->"
"""The line in benchmarks/README.md's speed-up section under which a new kind of run's block goes."""
PERCENT = 100.0
MS_PER_S = 1000.0
ACCURACY_TOLERANCE_POINTS = 0.5
SPEEDUP_TARGETS = {"text": {"no_freeze": 2.5, "plain": 2.0}}
"""The first issue's speed-up targets for ``all``, per task (``plain``: the faster plain baseline; the issue named
``ddp``, the faster one then); the ViT task has an accuracy target only."""
REFERENCE_PAD_TO = 64  # the first measurement's fixed length, measured beside the batch's-longest one


def _layout_path(summary: dict[str, Any]) -> str:
    """The layouts a run went through: ``@step frozen-layers stages x dp-width``."""
    parts = []
    for entry in summary.get("layout_history", []):
        cached = f" c{entry['cached_blocks']}" if entry.get("cached_blocks") else ""
        parts.append(f"@{entry['step']} {entry['frozen_layers']}f {entry['stages']}x{entry['dp_width']}{cached}")
    return " → ".join(parts) if parts else "-"


def _aggregate(results: list[RunResult]) -> dict[str, dict[str, Any]]:
    """Per config: medians over the repeats that finished."""
    table: dict[str, dict[str, Any]] = {}
    for member in FAMILY:
        done = [r for r in results if r.name == member and r.ok]
        failed = [r for r in results if r.name == member and not r.ok]
        if not done and not failed:
            continue
        table[member] = {
            "runs": len(done), "failed": len(failed), "errors": [r.error for r in failed],
            "test_accuracy": median([r.summary["test_accuracy"] for r in done]),
            "final_accuracy": median([r.summary["eval_accuracy"] for r in done]),
            "best_accuracy": median([r.summary["best_eval_accuracy"] for r in done]),
            "wall_time_s": median([r.summary["wall_time_s"] for r in done]),
            "wall_times_s": [r.summary["wall_time_s"] for r in done],
            "samples_per_s": median([r.summary["samples_per_s"] for r in done]),
            "load_mean": median([r.load_mean for r in done if r.load_mean is not None]),
            "load_max": max((r.load_max for r in done if r.load_max is not None), default=None),
            "layouts": _layout_path(done[-1].summary) if done else "-",
            "transitions": len(done[-1].summary.get("transitions", [])) if done else None,
            "transition_s": sum(t["seconds"] for t in done[-1].summary.get("transitions", [])) if done else None,
            "breakdown": step_breakdown(Path(done[-1].run_dir)) if done else [],
            "run_dirs": {r.repeat: r.run_dir for r in done},
        }
    faster_plain = _faster_plain(table)
    for row in table.values():
        for base, name in ((PAPER_BASELINE, PAPER_BASELINE), (faster_plain, "plain")):
            base_wall = table.get(base, {}).get("wall_time_s") if base else None
            row[f"speedup_over_{name}"] = base_wall / row["wall_time_s"] if base_wall and row["wall_time_s"] else None
    return table


def _faster_plain(table: dict[str, dict[str, Any]]) -> str | None:
    """The plain baseline with the shorter median wall time, among those that finished."""
    plain = [m for m in PLAIN_BASELINES if table.get(m, {}).get("wall_time_s")]
    return min(plain, key=lambda m: table[m]["wall_time_s"], default=None)


def _quoted(member: str | None) -> str:
    """A member's name as code, or "not run" when the run measured no such member."""
    return f"`{member}`" if member else "not run"


def _spread(row: dict[str, Any]) -> str:
    """The repeats' wall times as min-max, so a ratio of medians comes with the spread behind it."""
    walls = row["wall_times_s"]
    return f"{min(walls):.1f}-{max(walls):.1f}" if len(walls) > 1 else "-"


def _targets(task: str, table: dict[str, dict[str, Any]]) -> list[str]:
    """The issue's targets for ``all``, with the measured margin (met or missed)."""
    row = table.get("all")
    if row is None or row["test_accuracy"] is None:
        return ["- `all` did not finish: no target can be checked."]
    lines = []
    for name, label in ((PAPER_BASELINE, f"`{PAPER_BASELINE}`"),
                        ("plain", f"the faster plain baseline ({_quoted(_faster_plain(table))})")):
        got = row.get(f"speedup_over_{name}")
        target = SPEEDUP_TARGETS.get(task, {}).get(name)
        if got is None:
            continue
        if target is None:
            lines.append(f"- speed-up over {label}: {got:.2f}x (no speed-up target for this task)")
        else:
            verdict = "met" if got >= target else f"MISSED by {target - got:.2f}x"
            lines.append(f"- speed-up over {label}: {got:.2f}x (target >= {target}x): {verdict}")
    baselines = [b for b in (*PLAIN_BASELINES, PAPER_BASELINE) if table.get(b, {}).get("test_accuracy") is not None]
    if baselines:
        best = max(baselines, key=lambda b: table[b]["test_accuracy"])
        gap = (table[best]["test_accuracy"] - row["test_accuracy"]) * PERCENT
        missed_by = gap - ACCURACY_TOLERANCE_POINTS
        verdict = "met" if missed_by <= 0 else f"MISSED by {missed_by:.2f} points"
        lines.append(f"- test accuracy (final model) {row['test_accuracy'] * PERCENT:.2f}% vs the best baseline "
                     f"(`{best}`) {table[best]['test_accuracy'] * PERCENT:.2f}% ({-gap:+.2f} points; target within "
                     f"{ACCURACY_TOLERANCE_POINTS}): {verdict}")
    paired = _paired_line(table)
    if paired:
        lines.append(paired)
    disturbed = [f"`{m}` {r['load_mean']:.1f}" for m, r in table.items()
                 if r["load_mean"] is not None and r["load_mean"] > DISTURBED_LOAD]
    if disturbed:
        lines.append(f"- DISTURBED: mean load above {DISTURBED_LOAD} during {', '.join(disturbed)}: other work "
                     "shared the 2 cores, so wall times and ratios are not trustworthy; rerun on a quiet machine")
    return lines


def _test_rows(run_dir: str) -> list[float] | None:
    """Each test row's correctness of a run's final model (``test_samples.json``), None when not recorded."""
    path = Path(run_dir) / TEST_SAMPLES_FILE
    return [float(v) for v in json.loads(path.read_text())["final"]] if path.is_file() else None


def _paired_line(table: dict[str, dict[str, Any]]) -> str | None:
    """With seeded repeats (``--seeds-per-repeat``): `all` against the faster plain baseline paired by seed and test row,
    mean ± SE over seeds and rows (``report.combined_se``)."""
    plain = _faster_plain(table)
    if "all" not in table or plain is None or not table["all"].get("seeded"):
        return None
    repeats = sorted(set(table["all"]["run_dirs"]) & set(table[plain]["run_dirs"]))
    rows = [_test_rows(table["all"]["run_dirs"][r]) for r in repeats]
    base = [_test_rows(table[plain]["run_dirs"][r]) for r in repeats]
    if not repeats or any(r is None for r in (*rows, *base)):
        return None
    difference, se = combined_se(rows, base)  # type: ignore[arg-type]
    verdict = "met" if difference * PERCENT >= -ACCURACY_TOLERANCE_POINTS else "MISSED"
    return (f"- test accuracy paired with `{plain}` by seed and row ({len(repeats)} seeds): "
            f"{difference * PERCENT:+.2f} ± {se * PERCENT:.2f} points (target >= -{ACCURACY_TOLERANCE_POINTS}): "
            f"{verdict}")


def _breakdown_table(table: dict[str, dict[str, Any]]) -> str:
    phases = ("data_s", "forward_s", "backward_s", "forward_backward_s", "allreduce_s", "control_s", "optimizer_s")
    rows = []
    for member in (m for m in FAMILY if m in table):
        for seg in table[member]["breakdown"]:
            rows.append([member, f"{seg['frozen_layers']}f {seg['stages']}x{seg['dp_width']}", seg["logged_steps"],
                         fmt(seg["step_s"] * MS_PER_S, 0), fmt(seg["samples_per_s"], 1),
                         *[fmt(seg[p] * MS_PER_S, 0) if p in seg else "-" for p in phases],
                         fmt(seg.get("cache_hit_rate"), 2)])
    header = ["config", "layout", "logged steps", "step ms", "samples/s", "data ms", "fwd ms", "bwd ms",
              "fwd+bwd (pipe) ms", "allreduce ms", "control ms", "optim ms", "cache hit"]
    return markdown_table(header, rows)


def _markdown(task: str, spec: TaskSpec, args: argparse.Namespace, split: list[str], table: dict[str, dict[str, Any]],
              machine: dict[str, Any], reference: list[dict[str, Any]], png: str | None,
              backbone: dict[str, Any] | None) -> str:
    rows = []
    for member in (m for m in FAMILY if m in table):
        row = table[member]
        rows.append([f"`{member}`", row["runs"], fmt(row["test_accuracy"] and row["test_accuracy"] * PERCENT),
                     fmt(row["final_accuracy"] and row["final_accuracy"] * PERCENT),
                     fmt(row["best_accuracy"] and row["best_accuracy"] * PERCENT),
                     fmt(row["wall_time_s"], 1), _spread(row), fmt(row["speedup_over_no_freeze"], 2, "x"),
                     fmt(row["speedup_over_plain"], 2, "x"), fmt(row["samples_per_s"], 1), row["layouts"],
                     fmt(row["load_mean"], 2)])
    header = ["config", "runs", "test acc %", "final val acc %", "best val acc %", "wall s (median)",
              "wall s (min-max)", "vs no_freeze", f"vs faster plain ({_quoted(_faster_plain(table))})", "samples/s",
              "layouts (@step frozen stages x dp, cN = cached blocks)", "load avg"]
    mode = "quick" if args.quick else "full"
    overrides = " ".join(f"--set {o}" for o in spec.quick_overrides("all")) if args.quick else "(none)"
    text = [f"# Speed-up, task `{task}` ({mode}), {NPROC} workers, {args.repeats} repeat(s)", "",
            f"Command: {_command(task, args)}", "",
            f"Machine: {machine['nproc']} cores, {machine['mem_total_gib']} GiB, torch {machine['torch']}, "
            f"Python {machine['python']}; load average at start {machine['load_average_at_start']}; "
            f"started {machine['started']}.", "",
            f"Configs `configs/{spec.prefix}_<name>.yaml`; every run adds `--set checkpoint.enabled=false "
            f"--set run.progress=false`; quick overrides: `{overrides}` (no `freeze.interval` for the baselines)"
            f"; split overrides: `{' '.join(split) or '(none)'}`.",
            "", *_backbone_lines(backbone),
            f"`single` runs the `ddp` config as one process using all {machine['nproc']} cores. Test accuracy "
            "is the final model's on the test split, evaluated once at the end; validation accuracy is what the "
            "runs saw while training. Wall time is the trainer's `wall_time_s` (training + evaluations, without "
            "process start-up and model loading); speed-ups are ratios of median wall times. `load avg` is the "
            "1-minute load average sampled every 5 s during the run (2 = the two workers alone).", "",
            markdown_table(header, rows), "", "## Targets (`all`)", "", *_targets(task, table), "",
            "## Where a step's time goes (last repeat, mean per logged step, by layout)", "",
            _breakdown_table(table), ""]
    failures = [f"- `{m}`: {e}" for m, row in table.items() for e in row["errors"]]
    if failures:
        text += ["## Failed runs", "", *failures, ""]
    if reference:
        text += ["## Plain-PyTorch reference (`reference_ddp.py`)", "",
                 markdown_table(["mode", "padding", "global batch", "timed steps", "median ms/step", "samples/s",
                                 "load avg"],
                                [[r["mode"], r["pad_to"], r["global_batch"], r["timed_steps"],
                                  fmt(r["median_step_s"] * MS_PER_S, 0), fmt(r["samples_per_s"], 1),
                                  fmt(r.get("load_mean"), 2)] for r in reference]),
                 "", "Compare with the `ddp` row's samples/s (which also includes evaluation time).", ""]
    if png:
        text += [f"![{task}: all vs baselines]({png})", ""]
    return "\n".join(text)


def _stem(kind: str, task: str, args: argparse.Namespace) -> str:
    """``[quick-]<kind>-<task>[-<config>...][-split<N>]``: a quick run, a subset of the family or another split gets
    its own files (and its own block in benchmarks/README.md), so it never overwrites a full run's."""
    split = f"-split{args.split_seed}" if args.split_seed is not None else ""
    return f"{'quick-' if args.quick else ''}{kind}-{task}" + "".join(f"-{m}" for m in _subset(args.configs)) + split


def _split_overrides(task: str, split_seed: int | None, runs_dir: Path) -> list[str]:
    """Fresh test rows for ``--split-seed``: ``data.split_seed``, and for the ViT the training files alone as an
    ``image_folder``, so its test rows come out of them instead of Fashion-MNIST's t10k, which earlier rounds read."""
    if split_seed is None:
        return []
    images = ["data.name=image_folder", f"data.path={fmnist_folder(runs_dir)}"] if task == "vit" else []
    return [*images, f"data.split_seed={split_seed}"]


def _command(task: str, args: argparse.Namespace) -> str:
    """The command that ran this task, as a reader would type it."""
    return (f"`.venv/bin/python benchmarks/speedup/main.py --task {task} --repeats {args.repeats}"
            f"{' --seeds-per-repeat' if args.seeds_per_repeat else ''}"
            f"{' --quick' if args.quick else ''}{_configs_flag(args.configs)}"
            f"{f' --split-seed {args.split_seed}' if args.split_seed is not None else ''}"
            f"{' --no-reference' if args.no_reference and task == 'text' else ''}`")


def _subset(configs: list[str]) -> list[str]:
    """The members a run measured, in family order, when it measured a subset; empty for the whole family."""
    return [] if set(configs) == set(FAMILY) else [m for m in FAMILY if m in configs]


def _configs_flag(configs: list[str]) -> str:
    """`` --configs ...`` when a run measured a subset of the family, so its results file gives the command it ran."""
    subset = _subset(configs)
    return " --configs " + " ".join(subset) if subset else ""


def _backbone_lines(backbone: dict[str, Any] | None) -> list[str]:
    if backbone is None:
        return []
    made = (f"made by this run in {backbone['made_here_s']:.0f} s" if backbone["made_here_s"] is not None
            else "reused from an earlier run")
    return [f"Every config fine-tunes `{backbone['path']}`: `pipetransformer pretrain configs/{backbone['config']} "
            f"--epochs {backbone['epochs']}` (masked-patch pretraining on the training images, no labels), {made}.",
            ""]


def _run_reference(runs_dir: Path) -> list[dict[str, Any]]:
    """The plain DDP reference, padded to each batch's longest and to a fixed 64 tokens."""
    results = []
    for pad_to in (None, REFERENCE_PAD_TO):
        out = runs_dir / f"reference-pad{pad_to or 'longest'}.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC),
                   str(HERE / "reference_ddp.py"), "--out", str(out), *(["--pad-to", str(pad_to)] if pad_to else [])]
        print(f"reference: {' '.join(command[2:])}", flush=True)
        log = runs_dir / f"reference-pad{pad_to or 'longest'}.log"
        with LoadSampler() as load, log.open("w") as handle:
            completed = subprocess.run(command, cwd=REPO_ROOT, stdout=handle, stderr=subprocess.STDOUT, check=False)
        if completed.returncode == 0 and out.is_file():
            results.append({**json.loads(out.read_text()), "load_mean": median(load.samples)})
        else:
            print(f"  reference FAILED (exit {completed.returncode}); see {log}", flush=True)
    return results


def _report(stem: str, results: list[RunResult], runs_dir: Path) -> str | None:
    """``pipetransformer report`` on the last finished ``all`` and baseline runs; one PNG copied next to the results."""
    dirs = []
    for member in REPORTED:
        done = [r for r in results if r.name == member and r.ok]
        if done:
            dirs.append(done[-1].run_dir)
    if len(dirs) < len(REPORTED):
        return None
    out = runs_dir / stem
    command = [sys.executable, "-m", "pipetransformer.cli", "report", *dirs, "--out", str(out)]
    completed = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        print(f"report FAILED: {completed.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    name = f"{stem}-{REPORT_PNG}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(out / REPORT_PNG, RESULTS / name)
    shutil.copyfile(out / "report.md", RESULTS / f"{stem}.md")
    return name


def _run_task(task: str, args: argparse.Namespace, machine: dict[str, Any]) -> dict[str, Any]:
    spec = TASKS[task]
    runs_dir = args.runs_dir / task
    runs_dir.mkdir(parents=True, exist_ok=True)
    members = [m for m in FAMILY if m in args.configs]
    backbone = ensure_backbone(spec, runs_dir)
    split = _split_overrides(task, args.split_seed, runs_dir)
    results = []
    for repeat, member in interleaved_order(members, args.repeats):
        variant = VARIANTS.get(member, Member(member))
        overrides = spec.quick_overrides(variant.family_member) if args.quick else []
        seed = [f"seed={repeat}"] if args.seeds_per_repeat else []
        results.append(run_training(member, spec.config(variant.family_member), repeat, runs_dir,
                                    [*overrides, *split, *variant.overrides, *seed], nproc=variant.nproc))
    reference = _run_reference(runs_dir) if task == "text" and not args.no_reference else []
    table = _aggregate(results)
    for row in table.values():
        row["seeded"] = args.seeds_per_repeat
    stem = _stem("results" + ("-seeded" if args.seeds_per_repeat else ""), task, args)
    png = _report(_stem("report", task, args), results, runs_dir)
    markdown = _markdown(task, spec, args, split, table, machine, reference, png, backbone)
    payload = {"task": task, "quick": args.quick, "repeats": args.repeats, "machine": machine,
               "spec": asdict(spec), "backbone": backbone, "table": table, "reference": reference, "runs": results}
    md_path, _ = write_results(RESULTS, stem, markdown, payload)
    _publish(task, stem, args, table, machine)
    print(f"results: {md_path}", flush=True)
    return {"table": table, "markdown": md_path}


def _publish(task: str, stem: str, args: argparse.Namespace, table: dict[str, dict[str, Any]],
             machine: dict[str, Any]) -> None:
    """This run's table and targets in benchmarks/README.md's speed-up section, as the block of its results file:
    a run of the same kind replaces its block, any other text of the section is kept."""
    rows = [[f"`{m}`", fmt(r["test_accuracy"] and r["test_accuracy"] * PERCENT), fmt(r["wall_time_s"], 1),
             _spread(r), fmt(r["speedup_over_no_freeze"], 2, "x"), fmt(r["speedup_over_plain"], 2, "x"),
             fmt(r["load_mean"], 2)]
            for m in FAMILY if (r := table.get(m)) is not None]
    body = [f"### {task} ({'quick' if args.quick else 'full'}, {args.repeats} repeat(s), started {machine['started']}, "
            f"load at start {machine['load_average_at_start']})", "", f"Command: {_command(task, args)}", "",
            markdown_table(["config", "test acc %", "wall s", "min-max", "vs no_freeze", "vs faster plain",
                            "load avg"], rows), "",
            *_targets(task, table), f"- files: `speedup/results/{stem}.md/json`"]
    replace_block(HERE.parent / "README.md", f"speedup/{stem}", "\n".join(body), README_ANCHOR)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="subset of the data, so one task takes ~15 minutes")
    parser.add_argument("--task", choices=(*TASKS, "both"), default="text")
    parser.add_argument("--repeats", type=int, default=1, help="runs per config, interleaved")
    parser.add_argument("--seeds-per-repeat", action="store_true",
                        help="repeat r runs with seed=r, so accuracy is paired with the plain baseline over seeds")
    parser.add_argument("--configs", nargs="+", choices=FAMILY, default=list(FAMILY),
                        help="a subset of the family (the speed-ups need no_freeze and ddp or single)")
    parser.add_argument("--runs-dir", type=Path, default=DEFAULT_RUNS_DIR, help="where run directories go")
    parser.add_argument("--no-reference", action="store_true", help="skip the plain-PyTorch DDP reference")
    parser.add_argument("--split-seed", type=int, default=None,
                        help="fresh test rows: data.split_seed (the ViT's test rows then come out of the training "
                             "files, not t10k); register the split before its first run")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    readme = HERE.parent / "README.md"
    if README_ANCHOR not in readme.read_text(encoding="utf-8"):
        parser.error(f"{readme} has no line {README_ANCHOR!r}: add it where this benchmark's new results should go")
    machine = machine_info()
    print(json.dumps(machine), flush=True)
    tasks = list(TASKS) if args.task == "both" else [args.task]
    for task in tasks:
        _run_task(task, args, machine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
