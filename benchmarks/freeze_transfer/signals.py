"""Convergence signals side by side: does any per-layer signal say the bottom layers converge before the top ones,
or do they all follow the run's phase and the learning rate?

The freeze-transfer issue asks for candidate tests measured side by side on the same run. One process trains a
task's ``ddp`` config as the benchmark does (same data subset, seed and schedule, nothing frozen) and, per block
and per decision window (5% of the run, the freeze default's cadence), records:

- ``grad_coherence``: ``sum_t g_t . g_(t-1) / sum_t |g_t|^2``, the default policy's signal (1: every step pushes the
  same way; 0: a random walk);
- ``grad_norm_change``: ``|mean |g| - previous window's| / previous``, the paper's gradient-norm test;
- ``weight_update``: ``|W_end - W_start| / |W_start|`` over the window, the relative weight update;
- ``weight_coherence``: ``|W_end - W_start| / sum_t |W_t - W_(t-1)|``, net displacement over path length, the
  update-space coherence after the optimizer's preconditioning (1: straight; ~1/sqrt(steps): a random walk);
- ``probe_drift``: ``|h_end - h_start| / |h_start|`` of the block's output on a fixed probe (the first
  ``--probe-rows`` validation samples).

The summary says, per signal over the transformer layers, what share of its variance lies between layers within a
window (the rest follows the window: time and learning rate), the mean rank correlation between layer depth and
the signal within a window (+1: it rises monotonically from the bottom layer to the top in every window), and
whether the layer pattern repeats from one window to the next (noise does not). A per-layer convergence test
needs a large layer share that repeats and is not fixed from the start.

    .venv/bin/python benchmarks/freeze_transfer/signals.py --task fashion_mnist     # ~1 min on 2 cores
    .venv/bin/python benchmarks/freeze_transfer/signals.py --task rotten_tomatoes   # ~4 min
    .venv/bin/python benchmarks/freeze_transfer/signals.py --task debates           # ~2 min

Writes ``results/signals-<task>.json`` and ``.md``. Training and validation samples only: no test data is read.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from main import TRANSFER_TASKS, transfer_tasks  # noqa: E402 - the benchmark's task definitions, one folder entry

from pipetransformer.config import Config, FreezeConfig, load_config  # noqa: E402
from pipetransformer.data import datasets_from_config  # noqa: E402
from pipetransformer.freeze.apply import PreviousGradients, block_grad_sq_norms  # noqa: E402
from pipetransformer.freeze.policies import window_steps  # noqa: E402
from pipetransformer.models import load_tokenizer, minilm_path  # noqa: E402
from pipetransformer.models.blocks import BlockSequence  # noqa: E402
from pipetransformer.optim import build_optimizer, layer_lr_scales, lr_at, set_lr  # noqa: E402
from pipetransformer.train.build import build_blocks  # noqa: E402

SIGNALS = ("grad_coherence", "grad_norm_change", "weight_update", "weight_coherence", "probe_drift")
LOG_SCALE = ("grad_norm_change", "weight_update", "probe_drift")
"""Ratios spanning decades: their variance is taken on log10 values."""
TINY = 1e-12


def block_outputs(model: BlockSequence, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Every block's output on the probe (eval mode, no gradient); text outputs masked to the real tokens."""
    model.eval()
    outputs, activation = [], inputs
    with torch.no_grad():
        for block in range(len(model)):
            activation = model.forward_range(activation, block, block + 1)
            hidden = activation[0].float()
            if len(inputs) == 2 and hidden.dim() == 3:  # text: (hidden, mask): padding carries no signal
                hidden = hidden * inputs[1].unsqueeze(-1)
            outputs.append(hidden.clone())
    model.train()
    return outputs


def flat_weights(model: BlockSequence) -> list[torch.Tensor]:
    """Each block's parameters as one detached vector (a copy)."""
    return [torch.cat([p.detach().reshape(-1) for p in block.parameters()]).clone() for block in model.blocks]


def relative(now: torch.Tensor, before: torch.Tensor) -> float:
    return float((now - before).norm() / before.norm().clamp_min(TINY))


def measure(config: Config, probe_rows: int) -> dict:
    torch.manual_seed(config.seed)
    tokenizer = None if config.model.kind == "vit" else load_tokenizer(config.model.path or minilm_path())
    splits = datasets_from_config(config.data, tokenizer)
    pad = config.data.max_length if tokenizer is not None else None
    model = build_blocks(config, splits.train.num_classes, torch.device("cpu"))
    scales = layer_lr_scales(len(model), config.train.layer_lr_decay)
    optimizer = build_optimizer(model.parameters(), config.train,
                                {p: scales[i] for i, block in enumerate(model.blocks) for p in block.parameters()})
    probe = splits.validation.get_batch(list(range(min(probe_rows, len(splits.validation)))), pad_to=pad).inputs
    batch_size, blocks = config.train.batch_size, len(model)
    steps_per_epoch = math.ceil(len(splits.train) / batch_size)
    total_steps = steps_per_epoch * config.train.epochs
    cadence = FreezeConfig()  # the freeze default's decision windows
    window = window_steps(float(cadence.interval), total_steps, cadence.min_window_steps)

    def fresh() -> dict[str, list[float]]:
        return {"dot": [0.0] * blocks, "sq": [0.0] * blocks, "norm": [0.0] * blocks, "path": [0.0] * blocks}

    outputs_before, weights_before = block_outputs(model, probe), flat_weights(model)
    weights = weights_before  # the weights after the latest step
    sums, steps_in_window, previous_grads, previous_mean_norm = fresh(), 0, PreviousGradients(), None
    windows, step, began = [], 0, time.perf_counter()
    generator = torch.Generator().manual_seed(config.seed)
    for _ in range(config.train.epochs):
        order = torch.randperm(len(splits.train), generator=generator)
        for first in range(0, len(order), batch_size):
            batch = splits.train.get_batch(order[first:first + batch_size], pad_to=pad)
            lr = lr_at(step, total_steps, config.train)
            set_lr(optimizer, lr)
            loss = torch.nn.functional.cross_entropy(model(*batch.inputs), batch.labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if config.train.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.train.grad_clip)
            squares = block_grad_sq_norms(model)
            dots, valid = previous_grads.block_dots(model, range(blocks))
            for b in range(blocks):
                sums["norm"][b] += math.sqrt(float(squares[b]))
                if valid[b]:
                    sums["dot"][b] += float(dots[b])
                    sums["sq"][b] += float(squares[b])
            optimizer.step()
            before_step, weights = weights, flat_weights(model)
            for b, w in enumerate(weights):
                sums["path"][b] += float((w - before_step[b]).norm())
            step += 1
            steps_in_window += 1
            if step % window == 0 or step == total_steps:
                outputs = block_outputs(model, probe)
                mean_norm = [n / steps_in_window for n in sums["norm"]]
                displacement = [float((w - s).norm()) for w, s in zip(weights, weights_before)]
                windows.append({
                    "step": step, "lr": lr,
                    "grad_coherence": [d / s if s > 0 else None for d, s in zip(sums["dot"], sums["sq"])],
                    "grad_norm_change": None if previous_mean_norm is None else
                    [abs(p - c) / p if p > 0 else None for p, c in zip(previous_mean_norm, mean_norm)],
                    "weight_update": [d / float(w.norm().clamp_min(TINY))
                                      for d, w in zip(displacement, weights_before)],
                    "weight_coherence": [d / p if p > 0 else None for d, p in zip(displacement, sums["path"])],
                    "probe_drift": [relative(n, p) for n, p in zip(outputs, outputs_before)]})
                outputs_before, weights_before, previous_mean_norm = outputs, weights, mean_norm
                sums, steps_in_window = fresh(), 0
    return {"blocks": model.block_names(), "total_steps": total_steps, "window_steps": window,
            "probe_rows": len(probe[0]), "seconds": time.perf_counter() - began, "windows": windows}


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    for rank, index in enumerate(order):
        ranks[index] = float(rank)
    return ranks


def layer_structure(result: dict, signal: str) -> dict[str, float | None]:
    """Over the transformer layers (not embeddings or head), from the windows where every layer has a value:
    ``layer_share``, the share of the signal's variance between layers within a window; ``depth_correlation``, the
    mean Spearman correlation of layer depth with the signal within a window; ``repeat``, the mean correlation of
    consecutive windows' layer profiles (each centred on its window's mean): near 1 when a layer pattern persists,
    near 0 when it is noise."""
    layers = range(1, len(result["blocks"]) - 1)
    rows = []
    for w in result["windows"]:
        values = w[signal]
        if values is None or any(values[b] is None for b in layers):
            continue
        row = [float(values[b]) for b in layers]
        rows.append([math.log10(max(v, TINY)) for v in row] if signal in LOG_SCALE else row)
    if len(rows) < 2:
        return {"layer_share": None, "depth_correlation": None, "repeat": None, "windows": len(rows)}
    cells = [v for row in rows for v in row]
    total = statistics.pvariance(cells)
    within = statistics.fmean(statistics.pvariance(row) for row in rows)
    depth = _ranks(list(map(float, range(len(layers)))))
    varied = [row for row in rows if len(set(row)) > 1]
    correlations = [statistics.correlation(depth, _ranks(row)) for row in varied]
    repeats = [statistics.correlation(a, b) for a, b in zip(rows, rows[1:]) if len(set(a)) > 1 and len(set(b)) > 1]
    return {"layer_share": within / total if total > 0 else None,
            "depth_correlation": statistics.fmean(correlations) if correlations else None,
            "repeat": statistics.fmean(repeats) if repeats else None, "windows": len(rows)}


def markdown(task: str, seed: int, result: dict) -> str:
    blocks = result["blocks"]
    lines = [f"# Convergence signals side by side: {task}, seed {seed}", "",
             f"One process, the `ddp` config's data and schedule, nothing frozen; {result['total_steps']} steps in "
             f"windows of {result['window_steps']}; probe: {result['probe_rows']} validation samples; "
             f"{result['seconds']:.0f} s. Command: `.venv/bin/python benchmarks/freeze_transfer/signals.py "
             f"--task {task} --seed {seed}`.", "",
             "Over the transformer layers: `layer share` is the share of the signal's variance (log10 for the ratios "
             "that span decades) between layers within a window, the rest follows the window; `depth correlation` "
             "is the mean rank correlation of layer depth with the signal within a window; `repeat` is the mean "
             "correlation of consecutive windows' layer profiles (near 0: the layer differences are noise).", "",
             "| signal | layer share | depth correlation | repeat | windows |", "| --- | --- | --- | --- | --- |"]
    for signal in SIGNALS:
        s = layer_structure(result, signal)
        share, corr, repeat = s["layer_share"], s["depth_correlation"], s["repeat"]
        lines.append(f"| `{signal}` | {'-' if share is None else f'{share:.1%}'} | "
                     f"{'-' if corr is None else f'{corr:+.2f}'} | {'-' if repeat is None else f'{repeat:+.2f}'} | "
                     f"{s['windows']} |")
    for signal in SIGNALS:
        lines += ["", f"## `{signal}` per window", "", "| step | lr | " + " | ".join(blocks) + " |",
                  "| --- | --- | " + " | ".join("---" for _ in blocks) + " |"]
        for w in result["windows"]:
            values = w[signal]
            cells = ["-"] * len(blocks) if values is None else ["-" if v is None else f"{v:.3g}" for v in values]
            lines.append(f"| {w['step']} | {w['lr']:.2e} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=TRANSFER_TASKS, default="fashion_mnist")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe-rows", type=int, default=64)
    parser.add_argument("--render", action="store_true", help="train nothing: rewrite the .md from the task's .json")
    args = parser.parse_args()
    recorded = HERE / "results" / f"signals-{args.task}.json"
    if args.render:
        if not recorded.is_file():
            parser.error(f"--render: {recorded} not found; run without --render first")
        result = json.loads(recorded.read_text())
    else:
        task = transfer_tasks()[args.task]
        config = load_config(task.config("ddp"), [*task.data, f"seed={args.seed}"])
        result = {"task": args.task, "seed": args.seed, **measure(config, args.probe_rows)}
        recorded.write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(args.task, result["seed"], result)
    recorded.with_suffix(".md").write_text(table)
    print(table.split("\n## ")[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
