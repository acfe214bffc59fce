"""The Hugging Face Trainer with and without AutoFreezeCallback: wall time and test accuracy, same task, same seeds.

MiniLM-L6 (``AutoModelForSequenceClassification``) fine-tuned on Rotten Tomatoes snippets by ``transformers.Trainer``
on 2 gloo processes under torchrun (1 thread each), the settings of ``configs/text_minilm_ddp.yaml``: global batch
32, AdamW lr 1e-4, weight decay 0.01, 6% linear warm-up then linear decay, gradient clip 1.0, 64 tokens at most
(batches padded to their longest), 3 epochs of the whole training split. The callback uses the package's default
freeze settings (``FreezeConfig()``), untuned here; the classification head is drawn from the run's seed. Test
accuracy is measured on the test split of ``--split-seed`` (52049 by default; the README counts its reads), paired
with the baseline by seed and by row. Runs are interleaved per seed (baseline first on even seeds, AutoFreeze first
on odd ones), so a disturbance of the shared machine hits both.

    .venv/bin/python benchmarks/integrations/main.py            # 3 seeds x 2 configurations, 75 min here
    .venv/bin/python benchmarks/integrations/main.py --quick    # 1,500 snippets, 1 epoch: about 10 minutes
    .venv/bin/python benchmarks/integrations/main.py --cache    # the callback serving the activation cache

``--cache`` gives the training rows their index (``idx``) and attaches the callback with the activation cache
(``attach(trainer, cache=...)``), so from the second epoch the frozen layers' output is served, not computed; its runs
go to their own folder (``runs-cache``). ``--set freeze.KEY=VALUE`` (as ``pipetransformer train --set``) runs the
callback with other freeze settings than the default, into folders named after them (``runs-freeze.policy=none``).

A finished run is recorded in the runs folder and not run again: a launch cut short goes on where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipetransformer.config import FreezeConfig, apply_overrides, config_from_dict
from pipetransformer.report import combined_se, seeds_difference

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from common import machine_info  # noqa: E402 - the shared helper lives one folder up

REPO_ROOT = HERE.parents[1]
SPLIT_SEED = 52049
"""The test split of the first runs (registered before them; the project's other runs use 0 and 52). A run that
judges a changed default passes a new ``--split-seed``: the README counts how often each split was read."""
SEEDS = (0, 1, 2)
CONFIGURATIONS = ("baseline", "autofreeze")
NPROC = 2
PER_DEVICE_BATCH = 16  # global batch 32, as configs/text_minilm.yaml
LEARNING_RATE = 1e-4
WEIGHT_DECAY = 0.01
WARMUP_RATIO = 0.06  # a float warmup_steps is a share of the run in transformers 5
GRAD_CLIP = 1.0
MAX_LENGTH = 64
EVAL_BATCH = 128
RUN_TIMEOUT_S = 3 * 3600
TARGET_SPEEDUP = 1.3
TARGET_ACCURACY_POINTS = 0.5
PERCENT = 100.0
FREEZE_PREFIX = "freeze."


@dataclass(frozen=True)
class Scale:
    train_rows: int | None  # None: the whole training split
    test_rows: int | None
    epochs: int


FULL = Scale(train_rows=None, test_rows=None, epochs=3)
QUICK = Scale(train_rows=1500, test_rows=512, epochs=1)


def worker(args: argparse.Namespace) -> None:
    """One run under torchrun: train, test once, and (rank 0) write the result as JSON."""
    import numpy as np
    import torch
    from transformers import (AutoModelForSequenceClassification, DataCollatorWithPadding, EvalPrediction, Trainer,
                              TrainingArguments, set_seed)

    from pipetransformer.config import CacheConfig
    from pipetransformer.data import SampleLimits, load_rotten_tomatoes
    from pipetransformer.integrations import AutoFreezeCallback
    from pipetransformer.models.hf import load_tokenizer, minilm_path

    torch.set_num_threads(1)
    scale = QUICK if args.quick else FULL
    tokenizer = load_tokenizer(minilm_path())
    splits = load_rotten_tomatoes(tokenizer, MAX_LENGTH, seed=args.split_seed,
                                  limits=SampleLimits(train=scale.train_rows, test=scale.test_rows))

    def rows(data: Any) -> list[dict[str, Any]]:  # unpadded: the collator pads each batch to its longest
        return [{"idx": i, "input_ids": data.input_ids[i, :data.lengths[i]].tolist(), "labels": int(data.labels[i])}
                for i in range(len(data))]  # idx: the cache's key (the Trainer drops it otherwise)

    def accuracy(prediction: EvalPrediction) -> dict[str, float]:
        return {"accuracy": float(np.mean(np.argmax(prediction.predictions, axis=-1) == prediction.label_ids))}

    set_seed(args.seed)  # the classification head is drawn here; the Trainer seeds only once the model exists
    model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=2)
    training = TrainingArguments(
        output_dir=tempfile.mkdtemp(), seed=args.seed, num_train_epochs=scale.epochs,
        per_device_train_batch_size=PER_DEVICE_BATCH, per_device_eval_batch_size=EVAL_BATCH,
        learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY, warmup_steps=WARMUP_RATIO, lr_scheduler_type="linear",
        max_grad_norm=GRAD_CLIP, use_cpu=True, ddp_backend="gloo", report_to=[], save_strategy="no",
        logging_steps=10, disable_tqdm=True, dataloader_num_workers=0,
        average_tokens_across_devices=False)  # else transformers doubles a classifier's loss and gradient under DDP
    trainer = Trainer(model=model, args=training, train_dataset=rows(splits.train), eval_dataset=rows(splits.test),
                      data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=accuracy)
    cache = CacheConfig(enabled=True) if args.cache else None
    callback = AutoFreezeCallback.attach(trainer, freeze_settings(args.set), cache=cache,
                                         cache_max_length=MAX_LENGTH) if args.configuration == "autofreeze" else None
    trained = trainer.train()
    tested = trainer.predict(trainer.eval_dataset)  # gathered over the ranks in the split's order
    correct = (np.argmax(tested.predictions, axis=-1) == tested.label_ids).astype(int).tolist()
    if trainer.is_world_process_zero():
        machine = machine_info()  # per run: a launch cut short may go on on another host
        Path(args.worker_out).write_text(json.dumps({
            "configuration": args.configuration, "seed": args.seed, "train_s": trained.metrics["train_runtime"],
            "samples_per_s": trained.metrics["train_samples_per_second"], "train_loss": trained.training_loss,
            "steps": trained.global_step, "test_accuracy": tested.metrics["test_accuracy"],
            "test_loss": tested.metrics["test_loss"], "test_correct": correct,
            "decisions": [{"step": d["global_step"], "frozen_layers": d["frozen_layers"]}
                          for d in (callback.decisions if callback else [])],
            "outcome": callback.freezer.outcome() if callback and callback.freezer else None,
            "cache_served_rank0": callback.freezer.cache.hits if callback and callback.freezer and callback.freezer.cache
            else None, **{key: machine[key] for key in ("cpu", "torch_cpu_capability")}}))


def _leave() -> None:
    """The worker's end, once rank 0 has written its result: a barrier, then the process ends without tearing gloo
    down. The Trainer's process group (made by Accelerate) is still alive here, and a normal exit would meet its gloo
    threads in the interpreter's finalization: "terminate called without an active exception", SIGABRT, now and then,
    which would fail a finished run (docs/teardown.md; the test workers end the same way)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def freeze_settings(overrides: Sequence[str]) -> FreezeConfig:
    """The callback's settings: the package's defaults with ``freeze.KEY=VALUE`` overrides (checked as the CLI's)."""
    wrong = [item for item in overrides if not item.startswith(FREEZE_PREFIX)]
    if wrong:
        raise SystemExit(f"error: --set {wrong[0]}: only freeze settings apply here (--set freeze.policy=none)")
    return config_from_dict(apply_overrides({}, list(overrides))).freeze


def _run(configuration: str, seed: int, quick: bool, split_seed: int, out: Path, cache: bool,
         overrides: Sequence[str] = ()) -> dict[str, Any]:
    """One run, or the record of it if an earlier launch into the same folder finished it (a launch can stop between
    runs and go on later: ``--seeds 2`` today, ``--seeds 3`` tomorrow runs the third seed's pair only)."""
    done_file = out / f"{configuration}-seed{seed}.done.json"
    if done_file.is_file():
        recorded = json.loads(done_file.read_text())
        if recorded.get("split_seed") != split_seed:
            raise SystemExit(f"error: {done_file} was run with --split-seed {recorded.get('split_seed')}, not "
                             f"{split_seed}: pass that split seed or a new --out folder")
        return recorded
    result_file = out / f"{configuration}-seed{seed}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}",
               str(Path(__file__).resolve()), "--worker", configuration, "--seed", str(seed),
               "--split-seed", str(split_seed), "--worker-out", str(result_file)] + (["--quick"] if quick else []) \
        + (["--cache"] if cache else []) + [option for item in overrides for option in ("--set", item)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT / "src")}
    started, load_before = time.time(), os.getloadavg()[0]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{configuration} seed {seed} failed:\n{done.stderr[-4000:]}")
    result = json.loads(result_file.read_text())
    result.update(wall_s=time.time() - started, load_before=load_before, load_after=os.getloadavg()[0],
                  split_seed=split_seed)
    done_file.write_text(json.dumps(result))
    return result


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per seed the speed ratio (baseline train time / AutoFreeze's), then median and range; the accuracy change
    paired by seed and, where the runs kept each test row's correctness, by row, with its standard error (the
    seeds' spread and the test set's own sampling error, ``report.combined_se``; the seeds' spread alone otherwise)."""
    by = {(r["configuration"], r["seed"]): r for r in results}
    seeds = sorted({r["seed"] for r in results})
    ratios = [by["baseline", s]["train_s"] / by["autofreeze", s]["train_s"] for s in seeds]
    deltas = [(by["autofreeze", s]["test_accuracy"] - by["baseline", s]["test_accuracy"]) * PERCENT for s in seeds]
    by_row = all("test_correct" in r for r in results)
    if by_row:
        difference, se = combined_se([by["autofreeze", s]["test_correct"] for s in seeds],
                                     [by["baseline", s]["test_correct"] for s in seeds])
        difference, se = difference * PERCENT, se * PERCENT
    else:
        difference, se = seeds_difference(deltas)
    mean_accuracy = {c: statistics.mean(by[c, s]["test_accuracy"] * PERCENT for s in seeds) for c in CONFIGURATIONS}
    return {"speed_ratio_median": statistics.median(ratios), "speed_ratio_range": [min(ratios), max(ratios)],
            "accuracy_points_mean_change": difference, "accuracy_points_se": se, "se_includes_test_rows": by_row,
            "accuracy_points_range": [min(deltas), max(deltas)], "mean_test_accuracy": mean_accuracy,
            "target_met": statistics.median(ratios) >= TARGET_SPEEDUP and difference >= -TARGET_ACCURACY_POINTS}


def _markdown(summary: dict[str, Any], results: list[dict[str, Any]], header: str) -> str:
    lines = [f"# integrations: Trainer with and without AutoFreezeCallback ({header})", "",
             "| configuration | seed | train s | samples/s | test accuracy | frozen layers (at step) | load |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        frozen = ", ".join(f"{d['frozen_layers']} ({d['step']})" for d in r["decisions"]) or "-"
        lines.append(f"| {r['configuration']} | {r['seed']} | {r['train_s']:.1f} | {r['samples_per_s']:.2f} | "
                     f"{r['test_accuracy'] * PERCENT:.2f} | {frozen} | {r['load_before']:.1f}-{r['load_after']:.1f} |")
    lines += [""] + [f"- AutoFreeze seed {r['seed']}: {r['outcome']}" for r in results if r["outcome"]]
    hosts = sorted({f"{r.get('cpu', 'not recorded')} ({r.get('torch_cpu_capability', '?')} kernels)" for r in results})
    lines += ["", f"CPU of the runs: {'; '.join(hosts)}."]
    low, high = summary["speed_ratio_range"]
    dlow, dhigh = summary["accuracy_points_range"]
    error = "over the seeds and the test rows" if summary["se_includes_test_rows"] else "over the seeds only"
    lines += ["", f"Speed ratio (baseline / AutoFreeze train time): median {summary['speed_ratio_median']:.3f}x, "
              f"range {low:.3f}-{high:.3f}. Test accuracy change: mean {summary['accuracy_points_mean_change']:+.2f} "
              f"± {summary['accuracy_points_se']:.2f} points (SE: {error}), range {dlow:+.2f} to {dhigh:+.2f} by "
              f"seed. Target (>= {TARGET_SPEEDUP}x within "
              f"{TARGET_ACCURACY_POINTS} points): {'met' if summary['target_met'] else 'not met'}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,500 training snippets, 1 epoch (a smoke run)")
    parser.add_argument("--seeds", type=int, default=len(SEEDS), help="training seeds (default 3)")
    parser.add_argument("--split-seed", type=int, default=SPLIT_SEED,
                        help=f"data.split_seed of the test rows (default {SPLIT_SEED}; a new one for a new default)")
    parser.add_argument("--cache", action="store_true", help="the callback serves the activation cache")
    parser.add_argument("--set", action="append", default=[], metavar="freeze.KEY=VALUE",
                        help="a freeze setting other than the default, for the callback (repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: results/ beside this script)")
    parser.add_argument("--worker", choices=CONFIGURATIONS, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.configuration = args.worker
        worker(args)
        _leave()
    freeze_settings(args.set)  # a wrong setting stops here, before any run
    out = args.out or HERE / "results"
    suffix = ("-quick" if args.quick else "") + ("-cache" if args.cache else "") + "".join(f"-{o}" for o in args.set)
    runs = out / f"runs{suffix}"
    runs.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in SEEDS[:args.seeds]:
        order = CONFIGURATIONS if seed % 2 == 0 else tuple(reversed(CONFIGURATIONS))
        for configuration in order:
            result = _run(configuration, seed, args.quick, args.split_seed, runs, args.cache, args.set)
            print(f"{configuration} seed {seed}: {result['train_s']:.1f} s, test accuracy "
                  f"{result['test_accuracy'] * PERCENT:.2f}, frozen {result['decisions']}", flush=True)
            results.append(result)
    summary = summarize(results)
    name = f"results{suffix}"
    header = f"{'--quick' if args.quick else 'full'}{', --cache' if args.cache else ''}" \
             f"{''.join(f', --set {o}' for o in args.set)}, " \
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, split_seed {args.split_seed}"
    (out / f"{name}.json").write_text(json.dumps({"header": header, "machine": machine_info(), "summary": summary,
                                                  "runs": results}, indent=1))
    (out / f"{name}.md").write_text(_markdown(summary, results, header))
    print(_markdown(summary, results, header))


if __name__ == "__main__":
    main()
