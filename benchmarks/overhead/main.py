"""The per-step cost of each automation before it pays: the same model, data and layout (1 stage x 2 replicas,
nothing frozen), with AutoFreeze (with and without AutoCache, which needs it), AutoPipe (with and without AutoDP,
which needs it) and all four together, against the plain step. AutoFreeze runs its statistics every step but cannot
freeze (``freeze.descent_threshold`` out of reach), so what is measured is what a run pays until its first freeze.

    .venv/bin/python benchmarks/overhead/main.py            # the ViT, 6 variants x 5 repeats: about 7 min on 2 cores
    .venv/bin/python benchmarks/overhead/main.py --text     # MiniLM-L6 instead (slower steps, 90 MB of gradients)
    .venv/bin/python benchmarks/overhead/main.py --quick    # 2 repeats of fewer steps: the machinery
    .venv/bin/python benchmarks/overhead/main.py --profile  # each variant once under torch.profiler: where it goes
    .venv/bin/python benchmarks/overhead/main.py --variants all --repeats 15  # plain and `all` only, more repeats
    .venv/bin/python benchmarks/overhead/main.py --one-process --out DIR      # 1 x 1 in one process (one GPU)

``--one-process`` runs the layout in one process: on a machine with one GPU (``dist.device: auto`` picks it), where two
processes cannot share it over NCCL; ``--out DIR`` writes the section and the results there, not into this folder
(the GPU check's ``overhead_vit`` step, ``benchmarks/gpu``).

Reported per variant: the wall time per step between its first and last settled logged steps (every step counts, read
or not: at the default ``run.log_every: 10`` the trainer reads the device only at logged steps and decisions), its
ratio to the plain run of the same repeat, the median time of the logged steps, and their phases (``control`` holds
the freezer's statistics and the one all-reduce of the control vector). The ViT starts from random weights
(``model.path=null``): a step costs the same, and no pretrained backbone has to be made first.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import (  # noqa: E402 - the shared helper lives one folder up
    CONFIG_DIR,
    NPROC,
    REPO_ROOT,
    SETTLED_AFTER_STEPS,
    interleaved_order,
    machine_info,
    markdown_table,
    replace_section,
    run_training,
    step_records,
)

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
RESULTS = HERE / "results"
RUNS_DIR = REPO_ROOT / "runs" / "benchmarks" / "overhead"
FROM_SCRATCH = ("model.path=null",)
NEVER_FREEZES = ("freeze.enabled=true", "freeze.descent_threshold=-1e9")
"""The freezer's statistics every step and its windows, but a threshold no descent t-statistic reaches."""
PIPE = ("pipe.enabled=true", "pipe.micro_batches=auto")
"""AutoPipe without a memory budget: the planner keeps the model on one stage."""
CACHE = ("cache.enabled=true", "cache.min_frozen=1")
VARIANTS: dict[str, tuple[str, ...]] = {
    "plain": (),
    "freeze": NEVER_FREEZES,
    "pipe": PIPE,
    "pipe+dp": (*PIPE, "dp.enabled=true"),  # AutoDP's replicas come from compressing the pipeline: it needs AutoPipe
    "freeze+cache": (*NEVER_FREEZES, *CACHE),  # the cache holds the frozen layers' output: it needs AutoFreeze
    "all": (*NEVER_FREEZES, *PIPE, "dp.enabled=true", *CACHE),
}
MODELS = {"vit": ("vit_fashion_ddp.yaml", 128), "text": ("text_minilm_ddp.yaml", 32)}
LOG_EVERY = 10
"""The default ``run.log_every``: what a user's run reads and records."""
PROFILED_STEPS = 10
"""``--profile``: this many settled steps, from the 20th on, under ``run.profile_steps``."""
PROFILE_FROM = 20
TOP_OPS = 12
PHASES = ("data_s", "forward_s", "backward_s", "allreduce_s", "control_s", "optimizer_s")
MS_PER_S = 1000.0


def _settled(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in step_records(run_dir) if r["step"] > SETTLED_AFTER_STEPS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", action="store_true", help="MiniLM-L6 on Rotten Tomatoes instead of the ViT")
    parser.add_argument("--quick", action="store_true", help="2 repeats of fewer steps")
    parser.add_argument("--profile", action="store_true",
                        help="each variant once under torch.profiler: ops, kernel launches and host syncs per step")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated variants to run against plain (of: {', '.join(VARIANTS)})")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats of each variant (default 5)")
    parser.add_argument("--one-process", action="store_true",
                        help="1 stage x 1 replica in one process (one GPU), not 1 x 2 in two")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the section and results into this directory, not README.md and results/")
    args = parser.parse_args()
    chosen = ["plain", *(name for name in args.variants.split(",") if name != "plain")]
    unknown = [name for name in chosen if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}: pass --variants with some of {', '.join(VARIANTS)}")
    if args.repeats is not None and args.repeats < 2:
        parser.error(f"--repeats {args.repeats}: pass at least 2, so the ratios have a spread")
    model = "text" if args.text else "vit"
    config_name, batch = MODELS[model]
    nproc = 1 if args.one_process else NPROC
    runs_dir = RUNS_DIR / (f"{model}-one-process" if args.one_process else model)
    if args.profile:
        profile(model, config_name, batch, nproc, args.out)
        return
    repeats, steps = (2, 40) if args.quick else (5, 130 if model == "vit" else 60)
    repeats = args.repeats or repeats
    overrides = (f"data.max_train_samples={steps * batch}", "data.max_eval_samples=64", "data.max_test_samples=64",
                 "train.epochs=1", "train.eval_every_steps=null", f"run.log_every={LOG_EVERY}",
                 "checkpoint.enabled=false", *FROM_SCRATCH)
    machine = machine_info()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in chosen}
    for repeat, name in interleaved_order(chosen, repeats):
        result = run_training(name, CONFIG_DIR / config_name, repeat, runs_dir, [*overrides, *VARIANTS[name]], nproc)
        if not result.ok:
            raise SystemExit(f"{name} repeat {repeat} failed: {result.error}")
        settled = _settled(Path(result.run_dir))
        layouts = {(r["stages"], r["dp_width"], r["frozen_layers"]) for r in settled}
        if layouts != {(1, nproc, 0)}:
            raise SystemExit(f"{name} ran layouts {sorted(layouts)}, not 1 stage x {_replicas(nproc)}, nothing frozen")
        runs[name].append({"repeat": repeat, "wall_step_s": _wall_per_step(settled),
                           "step_s": statistics.median(r["step_s"] for r in settled),
                           "steps": len(settled), "load_mean": result.load_mean,
                           "phases": {p: statistics.median(r.get(p, 0.0) for r in settled) for p in PHASES}})
    rows = []
    for name, done in runs.items():
        ratios = [run["wall_step_s"] / plain["wall_step_s"] for run, plain in zip(done, runs["plain"], strict=True)]
        logged = [run["step_s"] / plain["step_s"] for run, plain in zip(done, runs["plain"], strict=True)]
        rows.append([f"`{name}`", f"{statistics.median(r['wall_step_s'] for r in done) * MS_PER_S:.1f}",
                     ", ".join(f"{r['wall_step_s'] * MS_PER_S:.1f}" for r in done),
                     f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})",
                     f"{statistics.mean(ratios):.3f} ± {statistics.stdev(ratios) / len(ratios) ** 0.5:.3f}",
                     f"{statistics.median(r['step_s'] for r in done) * MS_PER_S:.1f}",
                     f"{statistics.median(logged):.3f}",
                     *(f"{statistics.median(r['phases'][p] for r in done) * MS_PER_S:.1f}" for p in PHASES),
                     sum(r["steps"] for r in done), ", ".join(f"{r['load_mean']:.1f}" for r in done)])
    subset = chosen != list(VARIANTS)
    command = "".join([" --text" if args.text else "", " --quick" if args.quick else "",
                       f" --variants {','.join(chosen[1:])}" if subset else "",
                       f" --repeats {args.repeats}" if args.repeats else "",
                       " --one-process" if args.one_process else ""])
    what = (" and ".join(f"`{name}`" for name in chosen[1:]) + " against plain" if subset
            else "each automation alone and together")
    body = "\n".join([
        f"## {model}{' in one process' if args.one_process else ''}: {what}, nothing frozen",
        "",
        f"`.venv/bin/python benchmarks/overhead/main.py{command}`, started {machine['started']} (load "
        f"{machine['load_average_at_start'][0]}), {machine['nproc']} cores, torch {machine['torch']}"
        f"{_device_note(machine)}: `{config_name}`, 1 stage x {_replicas(nproc)}, batch {batch}, {steps} steps a run, "
        f"{repeats} repeats taking turns, every {LOG_EVERY}th step logged. Step time: wall time per step from the "
        f"first settled logged step (after the first {SETTLED_AFTER_STEPS}) to the last, every step counted; the "
        "ratio is to the plain run of the same repeat (median, min-max; mean and its standard error). Logged: the "
        "median logged step, which reads the device, and its ratio; the phases are the logged steps' medians.",
        "",
        markdown_table(["variant", "step ms", "per repeat", "vs plain (min-max)", "mean ± s.e.", "logged ms",
                        "logged vs plain", *(p.removesuffix("_s") + " ms" for p in PHASES), "steps", "load"], rows),
    ])
    key = "-".join([model, *(["one-process"] if args.one_process else []),
                    *([name.replace("+", "_") for name in chosen[1:]] if subset else [])])
    results = {"machine": machine, "nproc": nproc, "runs": runs,
               "vs_plain": {row[0].strip("`"): row[3] for row in rows}}
    _write(args.out, key, results, body)
    print(body)


def _write(out: Path | None, key: str, results: dict[str, Any], body: str) -> None:
    """``results-<key>.json`` and the section: into ``out`` when given (a GPU machine's results travel as files),
    else into results/ and this folder's README."""
    (_folder(out) / f"results-{key}.json").write_text(json.dumps(results, indent=1))
    if out is not None:
        (out / f"overhead-{key}.md").write_text(body + "\n")
    else:
        replace_section(README, f"overhead-{key}", body, "## Results")


def _folder(out: Path | None) -> Path:
    """Where results go: ``out`` when given, else results/ beside this script (made if missing)."""
    folder = out if out is not None else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _replicas(nproc: int) -> str:
    return "1 replica in one process" if nproc == 1 else f"{nproc} replicas"


def _device_note(machine: dict[str, Any]) -> str:
    gpu = machine.get("gpu")
    return f", {gpu}" if gpu else ""


def _wall_per_step(settled: list[dict[str, Any]]) -> float:
    """Wall seconds per step from the first settled logged step to the last: the steps between count too."""
    first, last = settled[0], settled[-1]
    return (last["wall_s"] - first["wall_s"]) / (last["step"] - first["step"])


def _ops_by_self_time(ops_table: str) -> list[tuple[str, float]]:
    """``(name, self time in ms)`` of the top rows of a profile's ops table (``rank<R>-ops.txt``)."""
    rows = []
    for line in ops_table.splitlines():
        cells = re.split(r"\s{2,}", line.strip())  # fixed-width columns; a long name is cut with "..."
        if len(cells) < 3 or "::" not in cells[0]:
            continue
        rows.append((cells[0], _milliseconds(cells[2])))
    return rows[:TOP_OPS]


def _milliseconds(text: str) -> float:
    for unit, scale in (("ms", 1.0), ("us", 1e-3), ("s", 1e3)):
        if text.endswith(unit):
            return float(text.removesuffix(unit)) * scale
    raise ValueError(f"not a profiler time: {text}")


def profile(model: str, config_name: str, batch: int, nproc: int, out: Path | None) -> None:
    """Each variant once with ``run.profile_steps`` on settled steps: per step, the ops, kernel launches and host
    syncs (rank 0), and the ops taking most self time, into results/profile-<model>.md (or ``out``)."""
    first = PROFILE_FROM
    steps = first + PROFILED_STEPS + SETTLED_AFTER_STEPS
    overrides = (f"data.max_train_samples={steps * batch}", "data.max_eval_samples=64", "data.max_test_samples=64",
                 "train.epochs=1", "train.eval_every_steps=null", f"run.log_every={LOG_EVERY}",
                 "checkpoint.enabled=false", f"run.profile_steps=[{first},{first + PROFILED_STEPS - 1}]", *FROM_SCRATCH)
    machine = machine_info()
    rows, tops = [], []
    for name, extra in VARIANTS.items():
        result = run_training(name, CONFIG_DIR / config_name, 0, RUNS_DIR / f"{model}-profile-{nproc}",
                              [*overrides, *extra], nproc)
        if not result.ok:
            raise SystemExit(f"{name} failed: {result.error}")
        profiled = Path(result.run_dir) / "profile"
        counts = json.loads((profiled / "rank0.json").read_text())
        rows.append([f"`{name}`", *(f"{counts[key]:.0f}" for key in ("aten_ops_per_step", "kernel_launches_per_step",
                                                                       "synchronizing_calls_per_step",
                                                                       "async_copies_per_step"))])
        ops = _ops_by_self_time((profiled / "rank0-ops.txt").read_text())
        tops.append(f"- `{name}`: " + ", ".join(f"{op} {ms / PROFILED_STEPS:.1f}" for op, ms in ops))
    body = "\n".join([
        f"## {model}{' in one process' if nproc == 1 else ''}: where a step goes, under torch.profiler",
        "",
        f"`.venv/bin/python benchmarks/overhead/main.py{' --text' if model == 'text' else ''} --profile"
        f"{' --one-process' if nproc == 1 else ''}`, started {machine['started']} (load "
        f"{machine['load_average_at_start'][0]}), {machine['nproc']} cores, torch {machine['torch']}"
        f"{_device_note(machine)}: 1 stage x {_replicas(nproc)}, each variant once, steps {first}-"
        f"{first + PROFILED_STEPS - 1} profiled on rank 0 (`run.profile_steps`; the tables and Chrome traces stay in "
        "the runs' `profile/` folders).",
        "",
        markdown_table(["variant", "aten ops / step", "kernel launches / step", "host-sync calls / step",
                        "async copies / step"], rows),
        "",
        f"Ops by self time, ms per step (top {TOP_OPS}):",
        "",
        *tops,
    ])
    name = f"profile-{model}{'-one-process' if nproc == 1 else ''}.md"
    (_folder(out) / name).write_text(f"# Step overhead under the profiler\n\n{body}\n")
    print(body)


if __name__ == "__main__":
    main()
