"""Replay a finished run's per-step gradient norms through a freeze policy, offline.

Freeze settings (window length, ``alpha``, ``threshold``, ``percentile``, ``max_change``) are tuned far faster
this way than by training: a policy only ever sees per-layer gradient statistics (norms, the dot products
of consecutive gradients, and the descents ``-g_t . (w_t - w_{t-1})``), which a run logs with every step record of ``metrics.jsonl`` (``run.log_every: 1``). The replay is exact for a run that froze
nothing (a baseline): once layers freeze, every later gradient depends on that freeze.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipetransformer.freeze.policies import FreezeDecision, FreezePolicy

__all__ = ["LoggedStep", "ReplayError", "read_logged_steps", "replay"]

STEP_EVENT = "step"
FREEZE_EVENT = "freeze"


class ReplayError(ValueError):
    """The run cannot be replayed; the message says what to rerun."""


@dataclass(frozen=True)
class LoggedStep:
    step: int  # 1-based, as the trainer numbers them
    epoch: int
    layer_grad_norms: list[float]
    layer_grad_dots: list[float | None] | None = None  # logged when run.log_every is 1 (or the policy needs them)
    layer_descents: list[float | None] | None = None  # likewise


def read_logged_steps(metrics_path: Path) -> list[LoggedStep]:
    """Every step record of ``metrics.jsonl``, checked to cover every step of a run that froze nothing."""
    if not metrics_path.is_file():
        raise ReplayError(f"{metrics_path} not found: give a run directory (it holds metrics.jsonl)")
    steps: list[LoggedStep] = []
    with metrics_path.open() as lines:
        for line in lines:
            record = json.loads(line)
            if record.get("event") == FREEZE_EVENT:
                raise ReplayError(
                    f"{metrics_path.parent} froze layers at step {record['step']}, and every later gradient depends on "
                    "that: replay a run that froze nothing (a ddp or no_freeze baseline)")
            if record.get("event") == STEP_EVENT and "layer_grad_norms" in record:
                dots, descents = record.get("layer_grad_dots"), record.get("layer_descents")
                steps.append(LoggedStep(int(record["step"]), int(record["epoch"]), list(record["layer_grad_norms"]),
                                        None if dots is None else list(dots),
                                        None if descents is None else list(descents)))
    if not steps:
        raise ReplayError(f"{metrics_path} has no step records with gradient norms: rerun with --set run.log_every=1")
    gaps = [b.step for a, b in zip(steps, steps[1:]) if b.step != a.step + 1]
    if steps[0].step != 1 or gaps:
        first_gap = steps[0].step if steps[0].step != 1 else gaps[0]
        raise ReplayError(f"{metrics_path} skips steps (first missing before step {first_gap}): a policy must see "
                          "every step; rerun the run with --set run.log_every=1")
    return steps


def replay(policy: FreezePolicy, steps: Sequence[LoggedStep]) -> list[FreezeDecision]:
    """Feed ``steps`` to ``policy`` as the trainer does (observe, decide; once more at each epoch's end)."""
    decisions: list[FreezeDecision] = []
    for index, logged in enumerate(steps):
        policy.observe(logged.layer_grad_norms, logged.layer_grad_dots, logged.layer_descents)
        decision = policy.decide(logged.step, logged.epoch, epoch_end=False)
        if decision is not None:
            decisions.append(decision)
        last_of_epoch = index + 1 == len(steps) or steps[index + 1].epoch != logged.epoch
        if last_of_epoch:
            decision = policy.decide(logged.step, logged.epoch, epoch_end=True)
            if decision is not None:
                decisions.append(decision)
    return decisions
