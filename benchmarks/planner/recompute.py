"""Recomputation against a second stage, measured: the shipped MiniLM pipeline under its 0.5 GB budget.

Under ``pipe.device_memory_gb: 0.5`` MiniLM does not fit one worker, so the shipped static pipeline
(``text_minilm_no_freeze.yaml``) runs 2 stages x 1. With ``pipe.recompute: true`` the lever planner predicts that
one stage x 2 replicas recomputing some layers is faster, and takes it. Both run the same steps (no freezing),
interleaved, 3 repeats; the number is the median settled step time of each run.

    .venv/bin/python benchmarks/planner/recompute.py    # ~10 min
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

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
    settled_step_s,
)

README = Path(__file__).resolve().parent / "README.md"
INDEX_LINE = ("- Recomputation against a second stage: `.venv/bin/python benchmarks/planner/recompute.py` "
              "(6 training launches, ~10 min)")
RUNS_DIR = REPO_ROOT / "runs" / "benchmarks" / "planner_recompute"
RESULTS = Path(__file__).resolve().parent / "results" / "recompute-results.json"
CONFIG = CONFIG_DIR / "text_minilm_no_freeze.yaml"
REPEATS = 3
STEPS = 60
COMMON = (f"train.max_steps={STEPS}", "data.max_train_samples=2000", "train.eval_every_steps=100000",
          "run.log_every=1")
MEMBERS = {
    "pipeline": (),
    "recompute": ("pipe.recompute=true", "dp.enabled=true"),
}


def main() -> None:
    # no options: the parser gives --help and refuses stray arguments instead of starting a 10-20 minute run
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    machine = machine_info()
    results: dict[str, list[dict[str, object]]] = {name: [] for name in MEMBERS}
    for repeat, name in interleaved_order(list(MEMBERS), REPEATS):
        result = run_training(name, CONFIG, repeat, RUNS_DIR, [*COMMON, *MEMBERS[name]])
        if not result.ok:
            raise SystemExit(f"{name} repeat {repeat} failed: {result.error}")
        layout = result.summary["layout_history"][0]
        results[name].append({"step_s": settled_step_s(Path(result.run_dir)), "load_mean": result.load_mean,
                              "layout": layout, "peak_rss_bytes": result.summary["peak_rss_bytes"]})
    rows = []
    medians = {name: statistics.median(r["step_s"] for r in runs) for name, runs in results.items()}
    for name, runs in results.items():
        layout = runs[0]["layout"]
        rows.append([name, f"{layout['stages']} x {layout['dp_width']}", layout["micro_batches"],
                     ", ".join(map(str, layout["recomputed_blocks"])) or "-",
                     " / ".join(f"{r['step_s'] * 1e3:.0f}" for r in runs), f"{medians[name] * 1e3:.0f}",
                     f"{max(max(r['peak_rss_bytes']) for r in runs) / 2**20:.0f}",
                     " / ".join(f"{r['load_mean']:.1f}" for r in runs)])
    body = "\n".join([
        "## Recomputation against a second stage, measured",
        "",
        f"`.venv/bin/python benchmarks/planner/recompute.py`, started {machine['started']} on {machine['nproc']} "
        f"cores: `{CONFIG.name}` (MiniLM, budget 0.5 GB a worker, no freezing), {STEPS} steps of 32, "
        f"{REPEATS} interleaved repeats; step time is the median after step {SETTLED_AFTER_STEPS}.",
        "",
        markdown_table(["run", "layout", "M", "recomputed blocks", "step ms per repeat", "median ms",
                        "peak RSS MiB", "load per repeat"], rows),
        "",
        f"**One stage x 2 replicas with recomputation: {medians['pipeline'] / medians['recompute']:.2f}x the "
        "pipeline's speed** (ratio of the medians).",
    ])
    RESULTS.write_text(json.dumps({"machine": machine, "results": results}, indent=1))
    replace_section(README, "recompute", body, INDEX_LINE)
    print(body)


if __name__ == "__main__":
    main()
