"""Data-parallel gradient sync: MiniLM's token table all-reduced whole, against by the rows the batches touched.

Plain data parallelism (``text_minilm_ddp.yaml``: 1 stage x 2 replicas, nothing frozen), the two settings of
``dp.touched_rows_only`` taking turns. Each run trains the same steps on the same samples; the rows setting is exact,
so both must log the same losses. Reported: the settled step time (median after the first steps), its phases, the
bytes all-reduced per step, and the last loss of each run.

    .venv/bin/python benchmarks/sync/main.py            # ~6 min: 3 repeats of 40 steps each
    .venv/bin/python benchmarks/sync/main.py --quick    # ~2 min: 2 repeats of 20 steps
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import (  # noqa: E402 - the shared helper lives one folder up
    CONFIG_DIR,
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
INDEX = REPO_ROOT / "benchmarks" / "README.md"
INDEX_LINE = "- [sync](sync/README.md): data-parallel gradient sync, the token table whole vs by touched rows"
RUNS_DIR = REPO_ROOT / "runs" / "benchmarks" / "sync"
CONFIG = CONFIG_DIR / "text_minilm_ddp.yaml"
BATCH = 32
SETTINGS = {"whole": "dp.touched_rows_only=false", "rows": "dp.touched_rows_only=true"}
PHASES = ("forward_s", "backward_s", "allreduce_s", "control_s", "optimizer_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeats, steps = (2, 20) if args.quick else (3, 40)
    overrides = (f"data.max_train_samples={steps * BATCH}", "data.max_eval_samples=32", "data.max_test_samples=32",
                 "train.epochs=1", "train.eval_every_steps=null", "run.log_every=1")
    machine = machine_info()
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in SETTINGS}
    for repeat, name in interleaved_order(list(SETTINGS), repeats):
        result = run_training(name, CONFIG, repeat, RUNS_DIR, [*overrides, SETTINGS[name]])
        if not result.ok:
            raise SystemExit(f"{name} repeat {repeat} failed: {result.error}")
        records = step_records(Path(result.run_dir))
        settled = [r for r in records if r["step"] > SETTLED_AFTER_STEPS]
        results[name].append({
            "repeat": repeat, "step_s": statistics.median(r["step_s"] for r in settled), "load_mean": result.load_mean,
            "phases": {p: statistics.median(r.get(p, 0.0) for r in settled) for p in PHASES},
            "allreduce_bytes": statistics.median(r["allreduce_bytes"] for r in settled),
            "losses": [r["loss"] for r in records]})
    rows = []
    for name, runs in results.items():
        step = statistics.median(run["step_s"] for run in runs)
        phases = {p: statistics.median(run["phases"][p] for run in runs) for p in PHASES}
        rows.append([f"`{name}`", f"{step * 1e3:.0f}", ", ".join(f"{run['step_s'] * 1e3:.0f}" for run in runs),
                     *(f"{phases[p] * 1e3:.0f}" for p in PHASES),
                     f"{statistics.median(run['allreduce_bytes'] for run in runs) / 1e6:.1f}",
                     ", ".join(f"{run['load_mean']:.1f}" for run in runs)])
    whole = [run["step_s"] for run in results["whole"]]
    by_rows = [run["step_s"] for run in results["rows"]]
    ratios = [w / r for w, r in zip(whole, by_rows, strict=True)]  # repeat by repeat: neighbours in time
    same_losses = all(a["losses"] == b["losses"] for a, b in zip(results["whole"], results["rows"], strict=True))
    body = "\n".join([
        "## Token table all-reduced whole vs by touched rows",
        "",
        f"`.venv/bin/python benchmarks/sync/main.py{' --quick' if args.quick else ''}`, started {machine['started']} "
        f"(load {machine['load_average_at_start'][0]}), {machine['nproc']} cores, torch {machine['torch']}: "
        f"`text_minilm_ddp.yaml` (MiniLM-L6, 1 stage x 2 replicas, nothing frozen), {steps} steps of {BATCH}, "
        f"{repeats} repeats taking turns. Step time: median after the first {SETTLED_AFTER_STEPS} steps.",
        "",
        markdown_table(["setting", "step ms", "per repeat", *(p.removesuffix("_s") + " ms" for p in PHASES),
                        "all-reduced MB a step", "load"], rows),
        "",
        f"**By rows: {statistics.median(ratios):.2f}x** the step of the whole table (per repeat "
        + ", ".join(f"{r:.2f}x" for r in ratios) + "). Losses of every step "
        + ("identical in every repeat (the sum is exact)." if same_losses else "**differ** between the settings."),
    ])
    # kept with the README
    (HERE / "results" / "results.json").write_text(json.dumps({"machine": machine, "results": results}, indent=1))
    replace_section(README, "sync", body, "# Gradient sync benchmark")
    replace_section(INDEX, "sync", body.replace("## ", "## sync: ", 1), INDEX_LINE)
    print(body)


if __name__ == "__main__":
    main()
