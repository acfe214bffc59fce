"""AutoFreeze in a run: observe each step's gradient statistics, decide at the policy's windows, apply the
decision to the model and the optimizer, and record it.

The statistics come from the step's control vector (all-reduced), so every rank takes the same decision.
The policies themselves are pure (``freeze.policies``); freezing a live model is ``freeze.apply``. A new
frozen set then re-plans the layout (the trainer hands it to ``ElasticLayout.transition``).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pipetransformer.config import UNWINDOWED, Config, ConfigError
from pipetransformer.freeze.apply import PreviousGradients, PreviousWeights, freeze_blocks
from pipetransformer.freeze.policies import (FreezeDecision, FreezePolicy, FreezePrior, frozen_blocks,
                                             frozen_prefix_layers, policy_from_settings, resolve_prior)
from pipetransformer.optim import lr_at
from pipetransformer.models.blocks import BlockSequence
from pipetransformer.train.control import ControlVector
from pipetransformer.train.optimizer import HeldOptimizer

__all__ = ["AutoFreeze"]

logger = logging.getLogger(__name__)

EPOCHS = "epochs"
FRACTION = "fraction"
COHERENCE = "coherence"
DESCENT = "descent"


class AutoFreeze:
    """The freeze policy of a run and what it acts on."""

    def __init__(self, policy: FreezePolicy, model: BlockSequence, *, gradient_dots: bool, descents: bool = False,
                 prior: FreezePrior | None = None) -> None:
        self.policy = policy
        self.model = model
        self.prior = prior or FreezePrior(False, 0, "no prior given")
        # g_t . g_{t-1} per layer: the coherence policy's signal; -g_t . (w_t - w_{t-1}): the descent policy's. Each
        # is also computed, and logged for replay, when every step is logged.
        self.previous_grads = PreviousGradients() if gradient_dots else None
        self.previous_weights = PreviousWeights() if descents else None
        self._apply(None)  # the prior, before the optimizer is built

    @classmethod
    def from_config(cls, config: Config, model: BlockSequence, *, planned_steps: int, steps_per_epoch: int,
                    warn: bool) -> AutoFreeze:
        """``freeze.*`` for a run of ``planned_steps``; with ``warn``, says once when nothing can freeze."""
        f = config.freeze
        run_steps = min(planned_steps, config.train.max_steps or planned_steps)
        try:
            prior = resolve_prior(f.prior, model.num_layers, pretrained=config.model.pretrained)
            policy = policy_from_settings(f, model.num_layers, seed=config.seed, total_steps=planned_steps,
                                          enabled=f.enabled, prior_layers=prior.layers,
                                          learning_rates=[lr_at(step, planned_steps, config.train)
                                                          for step in range(run_steps)])
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if warn and f.enabled and f.policy not in UNWINDOWED:
            window = policy.interval * (steps_per_epoch if policy.interval_unit == EPOCHS else 1)
            needed = window * policy.windows_before_a_freeze(window)
            steps = min(planned_steps, config.train.max_steps or planned_steps)
            if needed > steps:
                if f.interval_unit == FRACTION and window == f.min_window_steps:  # the floor, not the fraction
                    remedy = "lower freeze.min_window_steps (the floor of a fraction window)"
                elif f.interval_unit == FRACTION:
                    remedy = "shorten freeze.interval"
                else:
                    remedy = "shorten freeze.interval (or use interval_unit: fraction)"
                logger.warning("freeze: the first decision needs %d steps but the run has %d, so nothing will "
                               "freeze; %s", needed, steps, remedy)
        if warn and f.enabled and prior.embeddings:
            logger.info("freeze: %s", prior.describe())
        every_step = config.run.log_every == 1
        return cls(policy, model, gradient_dots=policy.name == COHERENCE or every_step,
                   descents=policy.name == DESCENT or every_step, prior=prior if f.enabled else FreezePrior(False, 0, "freeze.enabled: false"))

    @property
    def frozen(self) -> frozenset[int]:
        return self.policy.frozen

    def prefix_layers(self) -> int:
        """Leading frozen layers: what a cache or a no-grad prefix can skip."""
        return frozen_prefix_layers(self.policy.frozen)

    def prefix_blocks(self) -> int:
        """Leading frozen blocks: the embeddings freeze with layer 0, or alone by the prior."""
        layers = self.prefix_layers()
        return layers + 1 if layers > 0 or self.prior.embeddings else 0

    def _apply(self, optimizer: HeldOptimizer | None) -> None:
        """Freeze the blocks of the policy's frozen layers and the prior's embeddings in the model (and out of
        ``optimizer``)."""
        blocks = set(frozen_blocks(self.policy.frozen, self.model.num_layers))
        if self.prior.embeddings:
            blocks.add(0)
        if blocks:
            freeze_blocks(self.model, blocks, optimizer.optimizer if optimizer is not None else None)

    def observe(self, control: ControlVector) -> tuple[list[float], list[float | None] | None,
                                                       list[float | None] | None]:
        """Feed one step's all-reduced statistics to the policy; returns them (norms, dot products, descents) for the
        record."""
        norms = control.layer_grad_norms()
        dots = control.layer_dots() if self.previous_grads is not None else None
        descents = control.descents() if self.previous_weights is not None else None
        self.policy.observe(norms, dots, descents)
        return norms, dots, descents

    def needs_statistics(self) -> bool:
        """Whether the next step's ``update`` may decide: the statistics of every step so far must be observed by
        then (the trainer reads them from the device at such steps). A schedule reads none."""
        return self.policy.name not in UNWINDOWED and self.policy.next_step_ends_a_window()

    def update(self, step: int, epoch: int, epoch_end: bool, optimizer: HeldOptimizer) -> dict[str, Any] | None:
        """Decide after an optimizer step (``epoch_end`` once more after an epoch's last); a new frozen set is
        applied (requires_grad off, eval mode, out of the optimizer) and its record returned, else None."""
        decision = self.policy.decide(step, epoch, epoch_end=epoch_end)
        if decision is None:
            return None
        self._apply(optimizer)
        return _record(decision)

    def start_record(self) -> dict[str, Any] | None:
        """The layers the policy froze before the first step beyond the prior (a schedule's entry at 0), as the
        record of a decision at step 0; None when there are none. A fresh run records it; a resumed one has it."""
        decision = self.policy.start_decision
        return None if decision is None else _record(decision)

    def summary(self, log: bool) -> dict[str, Any]:
        """What froze, or why nothing did, and what the prior froze: a user should not have to read the traces."""
        record = {"freeze_outcome": self.policy.outcome(), "freeze_prior": self.prior.describe(),
                  "freeze_prior_layers": self.prior.layers}
        if log:
            logger.info("freeze: %s", record["freeze_outcome"])
        return record

    def window_record(self) -> dict[str, Any] | None:
        """The numbers of the decision window that ended at the last ``update`` (``None`` when none did), frozen
        or not: a run that froze nothing shows why in its metrics."""
        window = self.policy.last_window
        return None if window is None else {k: v for k, v in window.items() if _jsonable(v)}

    def state_dict(self) -> dict[str, Any]:
        return self.policy.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The policy's counters and frozen set, applied to the model (its optimizer is built afterwards)."""
        self.policy.load_state_dict(state)
        self._apply(None)


def _record(decision: FreezeDecision) -> dict[str, Any]:
    return {"step": decision.step, "epoch": decision.epoch, "frozen": sorted(decision.frozen),
            **{k: v for k, v in decision.details.items() if _jsonable(v)}}


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except TypeError:
        return False
    return True
