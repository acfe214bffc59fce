"""The built-in causal decoder trained three ways on the same windows: plain data parallelism (``ddp``), the paper's
static pipeline (``pipe``: the 2-stage layout the memory budget forces, nothing frozen) and all four automations
(``all``: ``configs/decoder_all.yaml``, whose pipeline compresses into replicas as layers freeze).

    .venv/bin/python benchmarks/decoder/main.py           # 3 seeds x 3 arms, interleaved: ~7 min on 2 cores
    .venv/bin/python benchmarks/decoder/main.py --quick   # 1 seed on a quarter of the windows: the machinery

Reported per arm: wall time (median, range) and its ratio to ``ddp``'s, training tokens per second, the final model's
test negative log-likelihood per token (nats; perplexity is its exponential) paired with ``ddp`` by seed and window,
and the layouts the run went through. The test windows are read once per launch, at the end of every run; the split
(``data.split_seed``, ``SPLIT_SEED``) was registered in this folder's README before any run on it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from pipetransformer.config import load_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import (  # noqa: E402 - the shared helper lives one folder up
    CONFIG_DIR,
    REPO_ROOT,
    RunResult,
    interleaved_order,
    machine_info,
    markdown_table,
    replace_section,
    run_training,
    write_results,
)

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
RESULTS = HERE / "results"
RUNS_DIR = REPO_ROOT / "runs" / "benchmarks" / "decoder"
CONFIG = CONFIG_DIR / "decoder_all.yaml"
SPLIT_SEED = 61
"""Registered 2026-12-05 (README), before any run on it: no other benchmark reads these windows."""
PLAIN = ("freeze.enabled=false", "cache.enabled=false", "dp.enabled=false")
ARMS: dict[str, tuple[str, ...]] = {
    "ddp": (*PLAIN, "pipe.enabled=false"),
    "pipe": PLAIN,  # the config's memory budget holds the model as 2 stages, kept for the whole run
    "all": (),
}
FULL = {"train": 8192, "eval": 1024, "test": 1024, "seeds": 3}
QUICK = {"train": 2048, "eval": 256, "test": 256, "seeds": 1}
EPOCHS = 3
TEST_SAMPLES_FILE = "test_samples.json"


def _layouts(summary: dict[str, Any]) -> str:
    """``2x1 -> @70 1x2 c3``: stages x replicas from the first step, then at each later layout (cN: cached blocks)."""
    parts = []
    for entry in summary["layout_history"]:
        shape = f"{entry['stages']}x{entry['dp_width']}" + (f" c{entry['cached_blocks']}" if entry["cached_blocks"]
                                                             else "")
        parts.append(shape if not parts else f"@{entry['step']} {shape}")
    return " -> ".join(parts)


def _rows_nll(run: RunResult) -> list[float]:
    return json.loads((Path(run.run_dir) / TEST_SAMPLES_FILE).read_text())["final"]


def _paired(runs: list[RunResult], baseline: list[RunResult]) -> tuple[float, float]:
    """Mean per-window test nll difference from the baseline of the same seed, and its SE: over seeds when there
    are several, else over the windows."""
    by_seed = [[a - b for a, b in zip(_rows_nll(run), _rows_nll(base), strict=True)]
               for run, base in zip(runs, baseline, strict=True)]
    means = [statistics.fmean(diffs) for diffs in by_seed]
    if len(means) > 1:
        return statistics.fmean(means), statistics.stdev(means) / math.sqrt(len(means))
    return means[0], statistics.stdev(by_seed[0]) / math.sqrt(len(by_seed[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 seed on a quarter of the windows")
    args = parser.parse_args()
    size = QUICK if args.quick else FULL
    data = (f"data.split_seed={SPLIT_SEED}", f"data.max_train_samples={size['train']}",
            f"data.max_eval_samples={size['eval']}", f"data.max_test_samples={size['test']}",
            f"train.epochs={EPOCHS}")
    machine = machine_info()
    runs: dict[str, list[RunResult]] = {name: [] for name in ARMS}
    for seed, name in interleaved_order(list(ARMS), size["seeds"]):
        result = run_training(name, CONFIG, seed, RUNS_DIR / ("quick" if args.quick else "full"),
                              [*data, f"seed={seed}", *ARMS[name]])
        if not result.ok:
            raise SystemExit(f"{name} seed {seed} failed: {result.error}")
        runs[name].append(result)
    for done in runs.values():
        done.sort(key=lambda run: run.repeat)
    tokens = size["train"] * EPOCHS * load_config(CONFIG).data.max_length
    baseline_wall = statistics.median(r.summary["wall_time_s"] for r in runs["ddp"])
    rows = []
    for name, done in runs.items():
        walls = [r.summary["wall_time_s"] for r in done]
        wall = statistics.median(walls)
        nll = statistics.fmean(r.summary["test_nll"] for r in done)
        paired = "" if name == "ddp" else "{:+.4f} ± {:.4f}".format(*_paired(done, runs["ddp"]))
        rows.append([f"`{name}`", len(done), f"{wall:.1f}", f"{min(walls):.1f}-{max(walls):.1f}",
                     f"{baseline_wall / wall:.2f}x", f"{tokens / wall:,.0f}", f"{nll:.4f}",
                     f"{math.exp(nll):.2f}", paired or "-", "; ".join(sorted({_layouts(r.summary) for r in done})),
                     ", ".join(f"{r.load_mean:.1f}" for r in done)])
    command = f".venv/bin/python benchmarks/decoder/main.py{' --quick' if args.quick else ''}"
    body = "\n".join([
        f"## Decoder{' (quick)' if args.quick else ''}: ddp, the static pipeline and all four automations",
        "",
        f"`{command}`, started {machine['started']} (load {machine['load_average_at_start'][0]}), {machine['nproc']} "
        f"cores, torch {machine['torch']}: `configs/decoder_all.yaml` (the built-in decoder, random init), "
        f"{size['train']} training windows x {EPOCHS} epochs, {size['test']} test windows of split {SPLIT_SEED}, "
        f"seeds 0-{size['seeds'] - 1}, arms interleaved.",
        "",
        markdown_table(["arm", "seeds", "wall s (median)", "range", "vs `ddp`", "train tokens/s", "test nll",
                        "perplexity", "nll - `ddp`, paired (± SE)", "layouts (stages x replicas, @step, cN cached)",
                        "load"], rows),
    ])
    stem = "results-quick" if args.quick else "results"
    write_results(RESULTS, stem, f"# Decoder benchmark\n\n{body}\n",
                  {"machine": machine, "size": size, "runs": {name: done for name, done in runs.items()}})
    replace_section(README, f"decoder-{stem}", body, "## Results")
    print(body)


if __name__ == "__main__":
    main()
