"""Shared helpers of the end-to-end benchmarks: run ``pipetransformer train`` jobs, read what they leave
behind, and write result tables.

Why a helper module: every published number must come from one command, and the machine is shared (2 cores),
so each benchmark interleaves its configurations, records the load average while each run trains, and
reports medians over repeats together with the machine it ran on.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipetransformer.config import FreezeConfig, load_config

__all__ = [
    "REPO_ROOT",
    "CONFIG_DIR",
    "NPROC",
    "BENCHMARK_OVERRIDES",
    "TEXT_FULL_TRAIN_SAMPLES",
    "VIT_FULL_TRAIN_SAMPLES",
    "BackboneSpec",
    "TaskSpec",
    "TASKS",
    "Member",
    "SETTLED_AFTER_STEPS",
    "settled_step_s",
    "step_records",
    "DISTURBED_LOAD",
    "RunResult",
    "LoadSampler",
    "interleaved_order",
    "scaled_interval",
    "ensure_backbone",
    "NO_BUDGET",
    "PACKAGE_FREEZER",
    "PACKAGE_ALL",
    "fmnist_folder",
    "run_training",
    "machine_info",
    "median",
    "step_breakdown",
    "markdown_table",
    "fmt",
    "write_results",
    "replace_section",
    "replace_block",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "configs"
NPROC = 2
"""Workers per run: the paper's comparison on this 2-core machine."""
BENCHMARK_OVERRIDES = ("checkpoint.enabled=false", "run.progress=false")
"""Checkpoints cost wall time none of the compared systems needs here; a progress bar only fills the logs."""
TEXT_FULL_TRAIN_SAMPLES = 11_477
"""Rotten Tomatoes training split (12,752 snippets minus the 10% validation split): scales quick intervals."""
VIT_FULL_TRAIN_SAMPLES = 60_000
"""Fashion-MNIST training images (the test split is the evaluation set)."""
BASELINE_MEMBERS = ("ddp", "no_freeze")
"""Family members that never freeze: quick runs leave their freeze settings alone."""
NON_PHASE_SECONDS = ("step_s", "wall_s", "samples_per_s")
"""Step-record fields ending in ``_s`` that are no phase of the step."""
DISTURBED_LOAD = 3.0
"""Mean 1-minute load above the two workers' 2.0 plus one: other work shared the cores during a run."""
LOAD_SAMPLE_PERIOD_S = 5.0
LOG_TAIL_LINES = 15


@dataclass
class RunResult:
    """One training run as the benchmark saw it: the trainer's summary plus the machine's load meanwhile."""

    name: str
    config: str
    repeat: int
    run_dir: str
    returncode: int
    launcher_s: float | None  # process start to exit: model loading and worker start-up included
    load_mean: float | None  # 1-minute load average sampled while the run trained
    load_max: float | None
    summary: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and bool(self.summary)


class LoadSampler:
    """Samples the 1-minute load average in a thread, so a disturbed run is visible in the results."""

    def __init__(self, period_s: float = LOAD_SAMPLE_PERIOD_S) -> None:
        self.period_s = period_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self.samples.append(os.getloadavg()[0])
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass(frozen=True)
class Member:
    """One compared configuration: a config of the task's family, overrides, and the worker count."""

    family_member: str
    overrides: tuple[str, ...] = ()
    nproc: int = NPROC


@dataclass(frozen=True)
class BackboneSpec:
    """How to make the pretrained backbone a family fine-tunes (its configs' ``model.path``) when it is missing."""

    config: str  # pretraining config in configs/
    epochs: int


@dataclass(frozen=True)
class TaskSpec:
    """One task's config family (``configs/<prefix>_<member>.yaml``) and how ``--quick`` shortens it."""

    prefix: str
    full_train_samples: int
    quick_train_samples: int
    quick_eval_samples: int
    quick_epochs: int
    backbone: BackboneSpec | None = None

    def config(self, member: str) -> Path:
        return CONFIG_DIR / f"{self.prefix}_{member}.yaml"

    def quick_overrides(self, member: str) -> list[str]:
        """A data subset; freeze decisions and evaluations scaled down with it, as often per epoch as at full size."""
        overrides = [f"data.max_train_samples={self.quick_train_samples}",
                     f"data.max_eval_samples={self.quick_eval_samples}", f"train.epochs={self.quick_epochs}"]
        config = load_config(self.config(member))  # intervals in steps, at full size
        if member not in BASELINE_MEMBERS and config.freeze.interval_unit == "steps":  # fractions scale themselves
            interval = scaled_interval(int(config.freeze.interval), self.full_train_samples, self.quick_train_samples)
            overrides.append(f"freeze.interval={interval}")
        if config.train.eval_every_steps:  # as many evaluations per epoch as the full run, for every member
            every = scaled_interval(config.train.eval_every_steps, self.full_train_samples, self.quick_train_samples)
            overrides.append(f"train.eval_every_steps={every}")
        return overrides


def interleaved_order(names: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """``(repeat, name)`` pairs: every repeat runs all names, rotated by one each time, so a slow phase of the
    shared machine does not always hit the same configuration."""
    order: list[tuple[int, str]] = []
    for repeat in range(repeats):
        shift = repeat % len(names)
        order.extend((repeat, name) for name in [*names[shift:], *names[:shift]])
    return order


def scaled_interval(interval: int, full_samples: int, quick_samples: int) -> int:
    """An interval in steps scaled to a smaller training set, so what it paces comes as often per epoch."""
    return max(1, round(interval * quick_samples / full_samples))


TASKS = {
    # Quick sizes keep one task's whole speed-up family within ~15 minutes on 2 cores; the static 2-stage
    # pipeline baseline is the slow member (~2.4 s per text step with 8 micro-batches).
    "text": TaskSpec("text_minilm", TEXT_FULL_TRAIN_SAMPLES, quick_train_samples=1000,
                     quick_eval_samples=500, quick_epochs=3),
    "vit": TaskSpec("vit_fashion", VIT_FULL_TRAIN_SAMPLES, quick_train_samples=8000,
                    quick_eval_samples=2000, quick_epochs=3,
                    backbone=BackboneSpec("vit_fashion.yaml", epochs=10)),  # 8-19 min on 2 cores, once
}


def ensure_backbone(spec: TaskSpec, runs_dir: Path) -> dict[str, Any] | None:
    """Make the family's pretrained backbone with ``pipetransformer pretrain`` unless it exists (quick runs
    fine-tune the same full backbone). Returns what was used (path, sha256) and, when made here, how long it took."""
    if spec.backbone is None:
        return None
    family_root = spec.config(BASELINE_MEMBERS[0])
    path = load_config(family_root).model.path
    if path is None:
        raise ValueError(f"{spec.prefix} has a backbone spec but {family_root.name} sets no model.path")
    info: dict[str, Any] = {"path": path, "config": spec.backbone.config, "epochs": spec.backbone.epochs,
                            "made_here_s": None}
    if (REPO_ROOT / path).is_file():
        return info | {"sha256": _sha256(REPO_ROOT / path)}
    command = [sys.executable, "-m", "pipetransformer.cli", "pretrain", str(CONFIG_DIR / spec.backbone.config),
               "--out", path, "--epochs", str(spec.backbone.epochs)]
    print(f"[{time.strftime('%H:%M:%S')}] no {path} yet: {' '.join(command[2:])}", flush=True)
    started = time.perf_counter()
    log_path = runs_dir / "pretrain.log"
    with log_path.open("w") as log:
        completed = subprocess.run(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, check=False)
    if completed.returncode != 0:
        raise RuntimeError(f"pretraining the backbone failed (exit {completed.returncode}); see {log_path}")
    info["made_here_s"] = time.perf_counter() - started
    return info | {"sha256": _sha256(REPO_ROOT / path)}


NO_BUDGET = "pipe.device_memory_gb=null"
"""The model fits one worker: the planner picks the layout, as a user without a memory limit gets."""
PACKAGE_FREEZER = (f"freeze.evidence_max_fraction={FreezeConfig.evidence_max_fraction}",
                   f"freeze.jitter_max_share={json.dumps(FreezeConfig.jitter_max_share)}")
"""``configs/vit_fashion_all.yaml`` keeps the README's first command as it was judged (at most 2 of 6 layers, no jitter
bound); benchmarks that compare freeze rules put the package's default back first, so their ``all`` arms run the
package's freezer (an arm's own settings come after it and win)."""
PACKAGE_ALL = (NO_BUDGET, *PACKAGE_FREEZER)
"""What every freeze-comparing arm built on ``configs/<task>_all.yaml`` starts from: no memory budget, the package's
freezer."""


FASHION_MNIST_SOURCE = Path("/usr/share/datasets/fashion-mnist")
"""Debian's Fashion-MNIST files, installed by scripts/setup.sh."""


def fmnist_folder(runs_dir: Path) -> str:
    """A folder holding only the Debian Fashion-MNIST training files (links), so ``image_folder`` carves its test
    split from them with ``data.split_seed`` instead of reading t10k, whose rows earlier runs read."""
    folder = runs_dir / "fashion_mnist_train_only"
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"):
        if not (FASHION_MNIST_SOURCE / name).is_file():
            raise SystemExit(f"error: {FASHION_MNIST_SOURCE / name} is missing: run bash scripts/setup.sh")
        link = folder / name
        if not link.exists():
            link.symlink_to(FASHION_MNIST_SOURCE / name)
    return str(folder)


def _sha256(path: Path) -> str:
    """Which backbone a run fine-tuned: pretraining need not be bit-identical across machines (it was on two VMs of
    2026-11-25, and was not on an earlier one), so accuracies pool only over runs of one backbone."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_training(name: str, config: Path, repeat: int, runs_dir: Path, overrides: Sequence[str],
                 nproc: int = NPROC) -> RunResult:
    """``pipetransformer train CONFIG --nproc-per-node N`` into a fresh ``runs_dir/<name>-r<repeat>``."""
    run_dir = runs_dir / f"{name}-r{repeat}"
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a stale summary.json must never pass for this run's
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = runs_dir / f"{name}-r{repeat}.log"
    command = [sys.executable, "-m", "pipetransformer.cli", "train", str(config), "--nproc-per-node", str(nproc),
               "--set", f"run.dir={run_dir}", "--set", f"run.name={name}",
               *[item for override in (*BENCHMARK_OVERRIDES, *overrides) for item in ("--set", override)]]
    print(f"[{time.strftime('%H:%M:%S')}] {name} (repeat {repeat}): {' '.join(command[2:])}", flush=True)
    started = time.perf_counter()
    with LoadSampler() as load, log_path.open("w") as log:
        completed = subprocess.run(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, check=False)
    elapsed = time.perf_counter() - started
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    error = None
    if completed.returncode != 0 or not summary:
        tail = log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        error = f"exit code {completed.returncode}; log {log_path}: " + " | ".join(line.strip() for line in tail)
        print(f"  FAILED: {error}", flush=True)
    result = RunResult(name, str(config.relative_to(REPO_ROOT)), repeat, str(run_dir), completed.returncode, elapsed,
                       statistics.fmean(load.samples) if load.samples else None, max(load.samples, default=None),
                       summary, error)
    if result.ok:
        best = {key.removeprefix("best_eval_"): value for key, value in summary.items() if key.startswith("best_eval_")}
        shown = ", ".join(f"best {metric} {value:.4f}" for metric, value in best.items() if value is not None)
        print(f"  wall {summary['wall_time_s']:.1f} s, {shown}, load {result.load_mean:.2f}", flush=True)
    _result_path(runs_dir, name, repeat).write_text(json.dumps(asdict(result), indent=1))
    return result


def _result_path(runs_dir: Path, name: str, repeat: int) -> Path:
    return runs_dir / f"{name}-r{repeat}.result.json"


def finished_run(name: str, repeat: int, runs_dir: Path) -> RunResult | None:
    """The result ``run_training`` recorded for this run, if it finished: lets an interrupted benchmark go on."""
    path = _result_path(runs_dir, name, repeat)
    if not path.is_file():
        return None
    result = RunResult(**json.loads(path.read_text()))
    return result if result.ok else None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor string where there is none."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on (cores, memory, versions, load when the benchmark started). The CPU model
    and the vector instructions torch dispatches to are kept because float results, and so a run's trajectory, can
    depend on them."""
    import torch

    meminfo = Path("/proc/meminfo").read_text().splitlines() if Path("/proc/meminfo").is_file() else []
    mem_kb = {line.split(":")[0]: int(line.split()[1]) for line in meminfo if line.split()[1:2]}
    kib_per_gib = 1024 ** 2
    return {
        "cpu": cpu_model(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "nproc": os.cpu_count(),
        "mem_total_gib": round(mem_kb.get("MemTotal", 0) / kib_per_gib, 1),
        "mem_available_gib": round(mem_kb.get("MemAvailable", 0) / kib_per_gib, 1),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


SETTLED_AFTER_STEPS = 5
"""Steps left out of a settled step time: the first carry start-up costs (first shapes, allocator growth)."""


def step_records(run_dir: Path) -> list[dict[str, Any]]:
    """A run's logged steps (``metrics.jsonl`` records of event ``step``), in order."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("event") == "step"]


def settled_step_s(run_dir: Path) -> float:
    """A run's median step time after its first ``SETTLED_AFTER_STEPS`` (needs ``run.log_every=1``)."""
    return statistics.median(r["step_s"] for r in step_records(run_dir) if r["step"] > SETTLED_AFTER_STEPS)


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def step_breakdown(run_dir: Path) -> list[dict[str, Any]]:
    """Mean seconds per phase of the logged steps, per layout (frozen layers, stages, dp width): shows where a
    configuration spends its time and how that changes as layers freeze."""
    groups: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return []
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if record.get("event") != "step" or record.get("step") == 1:  # step 1 carries warm-up costs
            continue
        key = (record["frozen_layers"], record["stages"], record["dp_width"])
        groups.setdefault(key, []).append(record)
    rows = []
    for (frozen, stages, dp_width), records in groups.items():
        phases = sorted({k for r in records for k in r if k.endswith("_s") and k not in NON_PHASE_SECONDS})
        row: dict[str, Any] = {"frozen_layers": frozen, "stages": stages, "dp_width": dp_width,
                               "logged_steps": len(records),
                               "step_s": statistics.fmean(r["step_s"] for r in records),
                               "samples_per_s": statistics.fmean(r["samples_per_s"] for r in records)}
        row.update({p: statistics.fmean(r.get(p, 0.0) for r in records) for p in phases})
        if any("cache_hit_rate" in r for r in records):
            row["cache_hit_rate"] = records[-1].get("cache_hit_rate")
        rows.append(row)
    return rows


def fmt(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(out_dir: Path, stem: str, markdown: str, payload: dict[str, Any]) -> tuple[Path, Path]:
    """``<stem>.md`` (what a reader sees) and ``<stem>.json`` (every run, for re-analysis)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md_path, json_path = out_dir / f"{stem}.md", out_dir / f"{stem}.json"
    md_path.write_text(markdown.rstrip() + "\n", encoding="utf-8")
    json_path.write_text(json.dumps(payload, indent=2, sort_keys=True, default=_jsonable) + "\n", encoding="utf-8")
    return md_path, json_path


def _jsonable(value: Any) -> Any:
    if isinstance(value, RunResult):
        return asdict(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def _marked(marker: str, body: str) -> str:
    """A generated block: ``body`` between ``<!-- marker:start -->`` and ``<!-- marker:end -->``."""
    return f"<!-- {marker}:start -->\n{body.rstrip()}\n<!-- {marker}:end -->"


def _with_block_replaced(text: str, marker: str, body: str) -> str | None:
    """``text`` with its block of that marker replaced by ``body``; None when it has no such block."""
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    if start not in text or end not in text:
        return None
    before, _, rest = text.partition(start)
    _, _, after = rest.partition(end)
    return before + _marked(marker, body) + after


def replace_section(path: Path, marker: str, body: str, index_line: str) -> None:
    """Put ``body`` between ``<!-- marker:start -->``/``<!-- marker:end -->`` in a shared README, leaving other
    engineers' sections alone; create the README with a short index if it is missing."""
    text = path.read_text(encoding="utf-8") if path.is_file() else (
        "# Benchmarks\n\nEvery number here comes from one command; each benchmark's README says which.\n\n")
    if index_line not in text:
        text = text.rstrip() + f"\n{index_line}\n"
    replaced = _with_block_replaced(text, marker, body)
    path.write_text(replaced if replaced is not None else text.rstrip() + "\n\n" + _marked(marker, body) + "\n",
                    encoding="utf-8")


def replace_block(path: Path, marker: str, body: str, anchor: str) -> None:
    """Put ``body`` between ``<!-- marker:start -->``/``<!-- marker:end -->`` in a README section that also holds
    hand-written history: a block with that marker is replaced, a new one goes right under the ``anchor`` line
    (newest first), and every other line of the file is kept."""
    text = path.read_text(encoding="utf-8")
    replaced = _with_block_replaced(text, marker, body)
    if replaced is None:
        if anchor not in text:
            raise ValueError(f"{path} has no line {anchor!r}: add it where new results of this benchmark should go")
        replaced = text.replace(anchor, f"{anchor}\n{_marked(marker, body)}", 1)
    path.write_text(replaced, encoding="utf-8")
