"""AutoFreeze alone on the text task: accuracy and wall time per freeze policy (the paper's Figure 10 sweep).

One command::

    .venv/bin/python benchmarks/freeze_sweep/main.py --quick
    .venv/bin/python benchmarks/freeze_sweep/main.py --repeats 3

Every variant is ``configs/text_minilm_freeze_only.yaml`` (plain data parallelism on 2 workers, frozen
layers run a no-grad forward, no cache, the layout never changes) with overrides: ``none`` (the freeze
machinery on, nothing frozen), ``geometric`` at alpha 1/5, 1/4, 1/3, 1/2, and ``gradient`` (the config's
own policy). Repeats are interleaved; results go to ``results/results.md`` / ``.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import (  # noqa: E402 - the shared helper lives one folder up
    DISTURBED_LOAD,
    NPROC,
    REPO_ROOT,
    TASKS,
    RunResult,
    fmt,
    interleaved_order,
    machine_info,
    markdown_table,
    median,
    replace_section,
    run_training,
    write_results,
)

__all__ = ["VARIANTS", "main"]

HERE = Path(__file__).resolve().parent
DEFAULT_RUNS_DIR = REPO_ROOT / "runs" / "benchmarks" / "freeze_sweep"
TASK = TASKS["text"]
MEMBER = "freeze_only"
REFERENCE_VARIANT = "none"
PERCENT = 100.0
VARIANTS: dict[str, list[str]] = {
    "none": ["freeze.policy=none"],
    "geometric-1/5": ["freeze.policy=geometric", "freeze.alpha=0.2"],
    "geometric-1/4": ["freeze.policy=geometric", "freeze.alpha=0.25"],
    "geometric-1/3": ["freeze.policy=geometric", "freeze.alpha=0.3333333"],
    "geometric-1/2": ["freeze.policy=geometric", "freeze.alpha=0.5"],
    "gradient": ["freeze.policy=gradient"],
}
PINNED_PRIOR = "freeze.prior=embeddings"
"""``auto`` until 2026-11-28, when it became a third of the layers: the variants keep the prior they had."""


def _freeze_path(summary: dict[str, Any]) -> str:
    """``@step frozen-count`` for every decision that changed the frozen set."""
    decisions = summary.get("freeze_decisions", [])
    return " → ".join(f"@{d['step']} {len(d['frozen'])}" for d in decisions) or "nothing frozen"


def _aggregate(results: list[RunResult]) -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = {}
    for variant in VARIANTS:
        done = [r for r in results if r.name == variant and r.ok]
        failed = [r for r in results if r.name == variant and not r.ok]
        if not done and not failed:
            continue
        table[variant] = {
            "runs": len(done), "errors": [r.error for r in failed],
            "final_accuracy": median([r.summary["eval_accuracy"] for r in done]),
            "best_accuracy": median([r.summary["best_eval_accuracy"] for r in done]),
            "wall_time_s": median([r.summary["wall_time_s"] for r in done]),
            "wall_times_s": [r.summary["wall_time_s"] for r in done],
            "samples_per_s": median([r.summary["samples_per_s"] for r in done]),
            "load_mean": median([r.load_mean for r in done if r.load_mean is not None]),
            "freezes": _freeze_path(done[-1].summary) if done else "-",
        }
    reference = table.get(REFERENCE_VARIANT, {}).get("wall_time_s")
    for row in table.values():
        row["speedup_over_none"] = reference / row["wall_time_s"] if reference and row["wall_time_s"] else None
    return table


def _rows(table: dict[str, dict[str, Any]]) -> list[list[Any]]:
    return [[f"`{v}`", (row := table[v])["runs"], fmt(row["final_accuracy"] and row["final_accuracy"] * PERCENT),
             fmt(row["best_accuracy"] and row["best_accuracy"] * PERCENT), fmt(row["wall_time_s"], 1),
             fmt(row["speedup_over_none"], 2, "x"), fmt(row["samples_per_s"], 1), row["freezes"],
             fmt(row["load_mean"], 2)] for v in VARIANTS if v in table]


HEADER = ["policy", "runs", "final acc %", "best acc %", "wall s (median)", "vs none", "samples/s",
          "freezes (@step layers frozen)", "load avg"]


def _disturbed(table: dict[str, dict[str, Any]]) -> list[str]:
    runs = [f"`{v}` {r['load_mean']:.1f}" for v, r in table.items()
            if r["load_mean"] is not None and r["load_mean"] > DISTURBED_LOAD]
    if not runs:
        return []
    return [f"DISTURBED: mean load above {DISTURBED_LOAD} during {', '.join(runs)}: other work shared the 2 cores, "
            "so these wall times are not trustworthy; rerun on a quiet machine.", ""]


def _readme_section(quick: bool, repeats: int, machine: dict[str, Any], table: dict[str, dict[str, Any]]) -> None:
    """This benchmark's section in benchmarks/README.md."""
    body = ["## Freeze sweep (`benchmarks/freeze_sweep`)", "",
            f"`.venv/bin/python benchmarks/freeze_sweep/main.py [--quick] [--repeats N]` "
            f"({'quick' if quick else 'full'} run, {repeats} repeat(s), load at start "
            f"{machine['load_average_at_start']}); details in [freeze_sweep/README.md](freeze_sweep/README.md).", "",
            markdown_table(HEADER, _rows(table)), "", *_disturbed(table)]
    replace_section(HERE.parent / "README.md", "freeze_sweep", "\n".join(body),
                    "- [freeze_sweep](freeze_sweep/README.md): AutoFreeze policies, accuracy vs wall time "
                    "(paper Fig. 10)")


def _markdown(args: argparse.Namespace, table: dict[str, dict[str, Any]], machine: dict[str, Any]) -> str:
    quick = " ".join(f"--set {o}" for o in TASK.quick_overrides(MEMBER)) if args.quick else "(none)"
    text = [f"# Freeze sweep, text task ({'quick' if args.quick else 'full'}), {NPROC} workers, "
            f"{args.repeats} repeat(s)", "",
            f"Command: `.venv/bin/python benchmarks/freeze_sweep/main.py --repeats {args.repeats}"
            f"{' --quick' if args.quick else ''}`", "",
            f"Machine: {machine['nproc']} cores, {machine['mem_total_gib']} GiB, torch {machine['torch']}, "
            f"Python {machine['python']}; load average at start {machine['load_average_at_start']}; "
            f"started {machine['started']}.", "",
            f"Config `configs/{TASK.prefix}_{MEMBER}.yaml` + `--set checkpoint.enabled=false --set "
            f"run.progress=false`; quick overrides: `{quick}`; per variant: "
            + "; ".join(f"`{v}`: `{' '.join(o)}`" for v, o in VARIANTS.items()) + ".", "",
            markdown_table(HEADER, _rows(table)), "", *_disturbed(table)]
    failures = [f"- `{v}`: {e}" for v, row in table.items() for e in row["errors"]]
    if failures:
        text += ["## Failed runs", "", *failures, ""]
    return "\n".join(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the speedup benchmark's quick data subset")
    parser.add_argument("--repeats", type=int, default=1, help="runs per variant, interleaved")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--runs-dir", type=Path, default=DEFAULT_RUNS_DIR, help="where run directories go")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    machine = machine_info()
    print(json.dumps(machine), flush=True)
    config = TASK.config(MEMBER)
    results = []
    for repeat, variant in interleaved_order(args.variants, args.repeats):
        overrides = [*(TASK.quick_overrides(MEMBER) if args.quick else []), *VARIANTS[variant], PINNED_PRIOR]
        results.append(run_training(variant.replace("/", "_"), config, repeat, args.runs_dir, overrides))
        results[-1].name = variant
    table = _aggregate(results)
    md_path, _ = write_results(HERE / "results", "results", _markdown(args, table, machine),
                               {"quick": args.quick, "repeats": args.repeats, "machine": machine, "table": table,
                                "runs": results})
    print(f"results: {md_path}", flush=True)
    _readme_section(args.quick, args.repeats, machine, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
