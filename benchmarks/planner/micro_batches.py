"""The micro-batch count, measured: every fixed count against AutoPipe's ``auto`` on the shipped static pipelines.

Both shipped pipelines (``text_minilm_no_freeze.yaml``, MiniLM under a 0.5 GB budget; ``vit_fashion_no_freeze.yaml``,
the ViT under 0.035 GB) run 2 stages x 1 with 1F1B. With 1F1B the count decides what must fit (stage 0 holds K
micro-batches before its first backward), so the split may change with it; ``auto`` chooses both together. Each
member runs the same steps (no freezing), interleaved, 3 repeats; the number is the median settled step time of a
run. A count whose split does not fit the budget is recorded as such.

    .venv/bin/python benchmarks/planner/micro_batches.py    # ~20 min
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
    TASKS,
    ensure_backbone,
    interleaved_order,
    machine_info,
    markdown_table,
    replace_section,
    run_training,
    settled_step_s,
)

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
INDEX_LINE = ("- The micro-batch count, measured: `.venv/bin/python benchmarks/planner/micro_batches.py` "
              "(30 training launches, ~20 min)")
RUNS_DIR = REPO_ROOT / "runs" / "benchmarks" / "planner_micro_batches"
RESULTS = HERE / "results" / "micro-batches-results.json"
REPEATS = 3
NO_FIT = "is too small for"
"""What the planner's error says when no split fits the memory budget (a run that failed otherwise is not that)."""
MEMBERS = ("2", "4", "8", "16", "auto")
PIPELINES = {
    "text": (CONFIG_DIR / "text_minilm_no_freeze.yaml", 30, ("data.max_train_samples=2000",)),
    "vit": (CONFIG_DIR / "vit_fashion_no_freeze.yaml", 60, ("data.max_train_samples=12000",)),
}
"""task -> (config, steps, data overrides): enough steps for a settled median at ~1 s (text) and ~0.1 s (ViT)."""


def _measure(task: str) -> list[dict[str, Any]]:
    config, steps, data = PIPELINES[task]
    (RUNS_DIR / task).mkdir(parents=True, exist_ok=True)
    if task == "vit":
        ensure_backbone(TASKS["vit"], RUNS_DIR / task)
    common = (*data, f"train.max_steps={steps}", "train.eval_every_steps=100000", "run.log_every=1",
              "data.max_eval_samples=256")
    runs = []
    for repeat, member in interleaved_order(list(MEMBERS), REPEATS):
        result = run_training(f"M{member}", config, repeat, RUNS_DIR / task, [*common, f"pipe.micro_batches={member}"])
        record: dict[str, Any] = {"member": member, "repeat": repeat, "load_mean": result.load_mean, "ok": result.ok}
        if result.ok:
            layout = result.summary["layout_history"][0]
            record.update(step_s=settled_step_s(Path(result.run_dir)), micro_batches=layout["micro_batches"],
                          bounds=layout["bounds"], stages=layout["stages"])
        else:
            record["error"] = result.error
        runs.append(record)
    return runs


def _section(task: str, runs: list[dict[str, Any]]) -> list[str]:
    config, steps, data = PIPELINES[task]
    medians = {m: statistics.median(r["step_s"] for r in runs if r["member"] == m and r["ok"])
               for m in MEMBERS if any(r["member"] == m and r["ok"] for r in runs)}
    rows = []
    for member in MEMBERS:
        mine = sorted((r for r in runs if r["member"] == member), key=lambda r: r["repeat"])
        done = [r for r in mine if r["ok"]]
        if not done:
            fits = not any(NO_FIT in (r.get("error") or "") for r in mine)
            rows.append([member, "failed (see the run logs)" if fits else "does not fit the budget", "-", "-", "-",
                         "-", " / ".join(f"{r['load_mean']:.1f}" for r in mine)])
            continue
        splits = sorted({json.dumps(r["bounds"]) for r in done})
        rows.append([member, "; ".join(splits), " / ".join(str(r["micro_batches"]) for r in done),
                     " / ".join(f"{r['step_s'] * 1e3:.0f}" for r in done), f"{medians[member] * 1e3:.0f}",
                     f"{medians[member] / min(medians.values()):.2f}",
                     " / ".join(f"{r['load_mean']:.1f}" for r in mine)])
    fastest = min(medians, key=medians.__getitem__)
    verdict = (f"**`auto` runs at {medians['auto'] / medians[fastest]:.2f}x the fastest member's step time**"
               f" (fastest: `{fastest}`)" if "auto" in medians else "**`auto` did not run**")
    return [f"### {task}: `{config.name}`, {steps} steps of {' '.join(data)}", "",
            markdown_table(["micro-batches", "split (block bounds)", "M per repeat", "step ms per repeat",
                            "median ms", "vs fastest", "load per repeat"], rows), "", verdict + ".", ""]


def main() -> None:
    # no options: the parser gives --help and refuses stray arguments instead of starting a 10-20 minute run
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    machine = machine_info()
    results = {task: _measure(task) for task in PIPELINES}
    body = "\n".join([
        "## The micro-batch count, measured",
        "",
        f"`.venv/bin/python benchmarks/planner/micro_batches.py`, started {machine['started']} on {machine['nproc']} "
        f"cores, torch {machine['torch']}: both shipped static pipelines (2 stages x 1, 1F1B, no freezing) at every "
        f"fixed count and at `auto`, {REPEATS} interleaved repeats; step time is the median after step "
        f"{SETTLED_AFTER_STEPS}. `M per repeat` is the count the run used (`auto`'s choice).",
        "",
        *[line for task, runs in results.items() for line in _section(task, runs)],
    ])
    RESULTS.write_text(json.dumps({"machine": machine, "results": results}, indent=1) + "\n")
    replace_section(README, "micro_batches", body, INDEX_LINE)
    print(body)


if __name__ == "__main__":
    main()
