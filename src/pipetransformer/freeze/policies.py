"""AutoFreeze decisions: which transformer layers stop training, and when.

Pure logic (numpy only) so every policy is unit-tested on synthetic gradient traces without torch.
Layers are 0-based transformer layer indices (layer ``i`` is block ``i + 1`` of a ``BlockSequence``);
the embeddings block freezes with layer 0 and the head never freezes.

Every policy is monotone (a frozen layer never thaws: its cached outputs and the pipeline built
around it stay valid). A run may start from a prior (``FreezePrior``: the embeddings, or the embeddings and
the bottom layers, frozen from the first step) that the policy then builds on. The policies that decide from
evidence (coherence, gradient) are bounded by the run's learning-rate budget (``budget_layers``) and by a depth cap
(``evidence_max_fraction``: the top layers keep training); a user's ``max_fraction``, when set, caps every deciding
policy; a schedule is the user's explicit plan and freezes what it lists.
Policies count steps and epochs themselves from ``decide`` calls (a step is counted when ``step``
differs from the previous call's), so how a trainer numbers its steps (0- or 1-based) cannot shift a
window, and a trainer may call once more at an epoch's end with the same ``step`` and
``epoch_end=True`` (it learns the epoch ended only when the sampler runs dry); the counters are part
of ``state_dict``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipetransformer.config import UNWINDOWED, FreezeConfig, check_freeze_values

__all__ = [
    "INTERVAL_UNITS",
    "PRETRAINED_PRIOR_SHARE",
    "FreezePrior",
    "POLICY_NAMES",
    "FreezeDecision",
    "CoherencePolicy",
    "DescentPolicy",
    "FreezePolicy",
    "GeometricPolicy",
    "GradientPolicy",
    "NoFreezePolicy",
    "RandomPolicy",
    "SchedulePolicy",
    "frozen_blocks",
    "frozen_prefix_layers",
    "geometric_frozen_count",
    "budget_layers",
    "make_policy",
    "policy_from_settings",
    "resolve_prior",
    "spent_shares",
    "window_steps",
]

INTERVAL_UNITS = ("steps", "epochs", "fraction")
POLICY_NAMES = ("descent", "coherence", "gradient", "geometric", "schedule", "random", "none")
PRIOR_AUTO, PRIOR_NONE, PRIOR_EMBEDDINGS = "auto", "none", "embeddings"
PRETRAINED_PRIOR_SHARE = 1 / 3
"""What ``freeze.prior: auto`` freezes from the first step of a model loaded with pretrained weights: the embeddings
and this share of the layers, rounded down (2 of 6, 4 of 12), one layer at least left training. Chosen on validation
in the freeze frontier's round ``choice`` (benchmarks/freeze_frontier): the fastest of four registered candidates,
each of which held the -0.5 point bound on two tasks of three. A model trained from random initialisation starts
with nothing frozen."""

FROZEN_BEFORE, FREEZES = "frozen", "freezes"
HELD_BY_BUDGET, HELD_BY_ADVANCE, HELD_BY_MAX_FRACTION = "held:budget", "held:max_advance", "held:max_fraction"
HELD_BY_EVIDENCE_CAP = "held:evidence_max_fraction"
HELD_BY_JITTER = "held:jitter_max_share"
NOT_LEARNED, LEARNING, ONE_WINDOW_BELOW, ABOVE_LEARNING = "not_learned", "learning", "one_window_below", "above_learning"
DESCENDING = "descending"
REASONS = {
    FROZEN_BEFORE: "frozen in an earlier window (or by the prior)",
    FREEZES: "converged: freezes in this window",
    HELD_BY_EVIDENCE_CAP: "converged, held back by freeze.evidence_max_fraction (the top layers keep training)",
    HELD_BY_BUDGET: "converged, held back by the learning-rate budget (budget_layers)",
    HELD_BY_JITTER: "converged, held back by freeze.jitter_max_share (the frozen prefix would hold too much of the "
                    "model's jitter)",
    HELD_BY_ADVANCE: "converged, held back by freeze.max_advance (one more layer per window)",
    HELD_BY_MAX_FRACTION: "converged, held back by freeze.max_fraction",
    NOT_LEARNED: "the test has not started: no learning seen yet (freeze.learned_by, learned_min_steps)",
    LEARNING: "its coherence is at or above the threshold: still learning",
    ONE_WINDOW_BELOW: "below the threshold in this window only (two in a row are needed)",
    ABOVE_LEARNING: "converged, but a layer below it is still learning (freezing is a prefix)",
    DESCENDING: "its updates still lower the loss on new batches: descent t at or above the threshold",
}
"""The coherence and descent policies' per-layer reason codes in each window's record, and what they mean."""

WINDOWS_BELOW = 2
"""Coherence and descent: consecutive windows below the threshold before a layer counts as converged (one window's
estimate is noisy)."""
LEARNING_T = 2.0
"""Descent: the model has learned once some layer's mean descent over a window was this many standard errors above
zero; before that, low descents mean learning has not started."""

# Slack when turning ``max_fraction * L`` into a layer count, so 0.29 * 100 = 28.999... still gives 29.
_FLOAT_SLACK = 1e-9
_LARGEST_FLOAT = float(np.finfo(np.float64).max)


@dataclass(frozen=True)
class FreezePrior:
    """What a run freezes at its first step, before any evidence: the embeddings, and the bottom ``layers``."""

    embeddings: bool
    layers: int
    source: str  # the setting and why it applies, for the run's record

    def describe(self) -> str:
        if not self.embeddings:
            return f"nothing frozen from the start ({self.source})"
        layers = f" and the bottom {self.layers} layer{'s' if self.layers > 1 else ''}" if self.layers else ""
        return f"the embeddings{layers} frozen from the first step ({self.source})"


def resolve_prior(setting: str | int, num_layers: int, *, pretrained: bool) -> FreezePrior:
    """``freeze.prior`` for a model: ``auto`` is the embeddings and ``PRETRAINED_PRIOR_SHARE`` of the layers for
    pretrained weights and ``none`` for a random initialisation; ``embeddings``; or an integer ``k``, the embeddings
    and the bottom ``k`` layers."""
    source = f"freeze.prior: {setting}"
    if setting == PRIOR_AUTO:
        source += ", pretrained weights" if pretrained else ", random initialisation"
        if not pretrained:
            return FreezePrior(False, 0, source)
        return FreezePrior(True, min(math.floor(PRETRAINED_PRIOR_SHARE * num_layers + _FLOAT_SLACK), num_layers - 1),
                           source)
    if setting == PRIOR_NONE:
        return FreezePrior(False, 0, source)
    if setting == PRIOR_EMBEDDINGS:
        return FreezePrior(True, 0, source)
    if isinstance(setting, bool) or not isinstance(setting, int) or not 0 <= setting < num_layers:
        raise ValueError(f"freeze.prior must be auto, none, embeddings or a layer count in 0..{num_layers - 1} "
                         f"(at least one layer keeps training), got {setting!r}")
    return FreezePrior(True, setting, source)


def spent_shares(learning_rates: Sequence[float]) -> list[float]:
    """Share of the run's learning rate spent after each step: ``sum(lr[:t+1]) / sum(lr)``."""
    total = float(sum(learning_rates))
    if total <= 0.0:
        return [1.0] * len(learning_rates)
    return [float(spent) / total for spent in np.cumsum(np.asarray(learning_rates, dtype=np.float64))]


def budget_layers(num_layers: int, prior_layers: int, spent: float) -> int:
    """How many layers evidence may have frozen once a share ``spent`` of the run's learning rate is spent:
    the prior's, and of the others the same share, rounded down.

    A layer frozen with a share ``r`` of the learning rate still to come forgoes that share of its updates, so
    freezing deeper only as the run spends its learning rate bounds what any layer can miss: at a third of it
    spent, a third of the layers above the prior; all of them only at the very end. It needs no tuning to the
    model's depth or the run's length."""
    return prior_layers + math.floor((num_layers - prior_layers) * spent + _FLOAT_SLACK)


@dataclass(frozen=True)
class FreezeDecision:
    """A new frozen set, when it was decided, and the numbers behind it (for metrics)."""

    frozen: frozenset[int]
    step: int
    epoch: int
    details: dict[str, Any] = field(default_factory=dict)


def frozen_prefix_layers(frozen: Iterable[int]) -> int:
    """Number of leading frozen layers: the part of the model a cache or a no-grad prefix can skip."""
    frozen_set = set(frozen)
    count = 0
    while count in frozen_set:
        count += 1
    return count


def frozen_blocks(frozen: Iterable[int], num_layers: int) -> frozenset[int]:
    """Block indices to freeze for the frozen layers: layer ``i`` is block ``i + 1``; embeddings go with layer 0."""
    layers = frozenset(frozen)
    outside = sorted(i for i in layers if not 0 <= i < num_layers)
    if outside:
        raise ValueError(
            f"frozen layer indices {outside} are outside 0..{num_layers - 1}: pass layer indices, not block indices"
        )
    blocks = {layer + 1 for layer in layers}
    if 0 in layers:
        blocks.add(0)
    return frozenset(blocks)


def _round_half_up(value: float) -> int:
    return math.floor(value + 0.5)


def geometric_frozen_count(num_layers: int, alpha: float, decision: int) -> int:
    """``round(L (1 - (1 - alpha)^T))``: each decision freezes a fraction ``alpha`` of the still-active layers."""
    return _round_half_up(num_layers * (1.0 - (1.0 - alpha) ** decision))


class FreezePolicy(ABC):
    """Decides the set of frozen layer indices; the trainer calls ``observe`` then ``decide`` after every step."""

    name: str

    def __init__(self, num_layers: int, *, interval: int, interval_unit: str, max_fraction: float | None,
                 prior_layers: int = 0, spent: Sequence[float] | None = None) -> None:
        self.num_layers = num_layers
        self.interval = interval
        self.interval_unit = interval_unit
        self.max_frozen = num_layers if max_fraction is None else math.floor(max_fraction * num_layers + _FLOAT_SLACK)
        self.prior_layers = prior_layers
        self.spent = list(spent) if spent is not None else None  # learning-rate share spent after each step
        self.frozen: frozenset[int] = frozenset(range(prior_layers))
        self.steps_done = 0
        self.epochs_done = 0
        self.windows_done = 0
        self.cap_binds = 0  # windows where the policy's bound held back layers its test found converged
        self.evidence_cap = num_layers  # the evidence policies' cap (``freeze.evidence_max_fraction``)
        self.last_step: int | None = None
        self.last_window: dict[str, Any] | None = None  # the numbers of a window that ended at the last decide()
        self.start_decision: FreezeDecision | None = None  # layers frozen before the first step beyond the prior

    def windows_before_a_freeze(self, window_steps: int) -> int:
        """Decision windows of ``window_steps`` steps the policy needs before it can freeze anything."""
        return 1

    def observe(self, layer_grad_norms: Sequence[float], layer_grad_dots: Sequence[float | None] | None = None,
                layer_descents: Sequence[float | None] | None = None) -> None:
        """Record one optimizer step's per-layer gradient norms ``||g_t||`` and, where the layer's previous step is
        known (``None`` elsewhere), the dot products ``g_t . g_{t-1}`` and the descents ``-g_t . (w_t - w_{t-1})``
        (layer 0's counting the embeddings, which freeze with it); ``L`` values each, frozen layers are ignored."""
        for name, values in (("gradient norm", layer_grad_norms), ("gradient dot product", layer_grad_dots),
                             ("descent", layer_descents)):
            if values is not None and len(values) != self.num_layers:
                raise ValueError(f"observe() needs one {name} per layer ({self.num_layers}), got {len(values)}")

    def next_step_ends_a_window(self) -> bool:
        """Whether ``decide`` for the next new step ends a decision window (one in epochs ends with an epoch): before
        it, every step's statistics must have been observed."""
        return self.interval_unit == "steps" and (self.steps_done + 1) % self.interval == 0

    def decide(self, step: int, epoch: int, epoch_end: bool) -> FreezeDecision | None:
        """Call after every optimizer step (``epoch_end`` on an epoch's last one); ``None`` means no change.

        A repeated ``step`` (an extra call to report the epoch's end) counts no new step. ``step`` and
        ``epoch`` also label the decision. When a window ended, ``last_window`` holds its numbers whether or not
        anything froze, so a run that froze nothing still shows why.
        """
        self.last_window = None
        new_step = step != self.last_step
        self.last_step = step
        if new_step:
            self.steps_done += 1
        if epoch_end:
            self.epochs_done += 1
        if self.interval_unit == "steps":
            window_end = new_step and self.steps_done % self.interval == 0
        else:
            window_end = epoch_end and self.epochs_done % self.interval == 0
        if window_end:
            self.windows_done += 1
        proposal = self._propose(window_end)
        if proposal is None:
            return None
        target, details = proposal
        target = self.frozen | target
        if window_end and self.name not in UNWINDOWED:
            self.last_window = {"step": step, "epoch": epoch, "window": self.windows_done,
                                "frozen": sorted(target), **details}
        if target == self.frozen:
            return None
        self.frozen = target
        return FreezeDecision(target, step, epoch, details)

    @abstractmethod
    def _propose(self, window_end: bool) -> tuple[frozenset[int], dict[str, Any]] | None:
        """The frozen set this policy wants after the current step (``None``: no opinion)."""

    def outcome(self) -> str:
        """One line for the end of a run: how much froze, or why nothing did."""
        if len(self.frozen) > self.prior_layers:
            return f"{len(self.frozen)} of {self.num_layers} layers frozen in {self.windows_done} decision windows"
        if min(self.max_frozen, self.evidence_cap) <= self.prior_layers:
            setting = "freeze.max_fraction" if self.max_frozen <= self.prior_layers else "freeze.evidence_max_fraction"
            return f"{self._nothing()}: {setting} allows no layer" + (" beyond it" if self.prior_layers else "")
        return f"{self._nothing()} in {self.windows_done} decision windows"

    def _nothing(self) -> str:
        if not self.prior_layers:
            return "nothing froze"
        return f"nothing froze beyond the prior's {self.prior_layers} layer{'s' if self.prior_layers > 1 else ''}"

    def _capped_prefix(self, count: int) -> frozenset[int]:
        """The first ``count`` layers, capped by ``max_fraction`` (never fewer than the prior)."""
        return frozenset(range(max(min(count, self.max_frozen), self.prior_layers)))

    def _bounded_prefix(self, candidate: int, bound: int) -> frozenset[int]:
        """The ``candidate`` layers a convergence test found, held to ``bound`` (counted in ``cap_binds`` when
        that holds back a layer ``max_fraction`` would let freeze)."""
        if min(candidate, self.max_frozen) > bound:
            self.cap_binds += 1
        return self._capped_prefix(min(candidate, bound))

    def spent_share(self) -> float | None:
        """Share of the run's learning rate spent so far (``None`` when the policy was given no schedule)."""
        if self.spent is None:
            return None
        if not self.spent or self.steps_done == 0:
            return 0.0
        return self.spent[min(self.steps_done, len(self.spent)) - 1]

    def _cap_evidence(self, evidence_max_fraction: float | None) -> None:
        """The evidence policies' depth cap: at most that share of the layers frozen, and never fewer than the prior."""
        if evidence_max_fraction is not None:
            self.evidence_cap = max(self.prior_layers,
                                    math.floor(evidence_max_fraction * self.num_layers + _FLOAT_SLACK))

    def budget(self) -> int:
        """Layers evidence may have frozen by now: the learning-rate budget (all of them without a schedule), within
        the evidence cap."""
        spent = self.spent_share()
        budget = self.num_layers if spent is None else budget_layers(self.num_layers, self.prior_layers, spent)
        return min(budget, self.evidence_cap)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable state: enough to make the same future decisions after a restart."""
        return {
            "policy": self.name,
            "num_layers": self.num_layers,
            "frozen": sorted(self.frozen),
            "steps_done": self.steps_done,
            "epochs_done": self.epochs_done,
            "windows_done": self.windows_done,
            "cap_binds": self.cap_binds,
            "last_step": self.last_step,
            "prior_layers": self.prior_layers,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["policy"] != self.name or state["num_layers"] != self.num_layers:
            raise ValueError(
                f"checkpoint holds a {state['policy']} policy over {state['num_layers']} layers, not "
                f"{self.name} over {self.num_layers}: set freeze.policy and the model as in the checkpoint"
            )
        if int(state.get("prior_layers", 0)) != self.prior_layers:  # absent from checkpoints before the prior
            raise ValueError(f"checkpoint froze {state.get('prior_layers', 0)} layers from the start, this run "
                             f"{self.prior_layers}: set freeze.prior as in the checkpoint")
        self.frozen = frozenset(int(i) for i in state["frozen"])
        self.steps_done = int(state["steps_done"])
        self.epochs_done = int(state["epochs_done"])
        self.windows_done = int(state["windows_done"])
        self.cap_binds = int(state.get("cap_binds", 0))  # absent from checkpoints of earlier versions
        self.last_step = None if state["last_step"] is None else int(state["last_step"])


class NoFreezePolicy(FreezePolicy):
    """Never freezes: the baseline."""

    name = "none"

    def _propose(self, window_end: bool) -> tuple[frozenset[int], dict[str, Any]] | None:
        return None

    def outcome(self) -> str:
        """It takes no decisions: what froze is the prior's."""
        return f"{self._nothing()}: freeze.policy is none"


class GeometricPolicy(FreezePolicy):
    """Freezes ``round(L (1 - (1 - alpha)^T))`` leading layers at the ``T``-th window end.

    This is the bound the 2021 PipeTransformer code actually applied, whatever the gradients said.
    """

    name = "geometric"

    def __init__(self, num_layers: int, *, alpha: float, **common: Any) -> None:
        super().__init__(num_layers, **common)
        self.alpha = alpha

    def _propose(self, window_end: bool) -> tuple[frozenset[int], dict[str, Any]] | None:
        if not window_end:
            return None
        bound = geometric_frozen_count(self.num_layers, self.alpha, self.windows_done)
        return self._capped_prefix(bound), {"decision_index": self.windows_done, "bound": bound, "cap": self.max_frozen}


class RandomPolicy(GeometricPolicy):
    """As many layers as ``geometric`` at each decision, but chosen at random among the active ones.

    An ablation: it tests whether *which* layers freeze matters, and its frozen set need not be a prefix.
    Each decision draws from a generator seeded by ``(seed, T)``, so it is reproducible without
    storing generator state.
    """

    name = "random"

    def __init__(self, num_layers: int, *, alpha: float, seed: int, **common: Any) -> None:
        super().__init__(num_layers, alpha=alpha, **common)
        self.seed = seed

    def _propose(self, window_end: bool) -> tuple[frozenset[int], dict[str, Any]] | None:
        if not window_end:
            return None
        bound = geometric_frozen_count(self.num_layers, self.alpha, self.windows_done)
        extra = min(bound, self.max_frozen) - len(self.frozen)
        if extra <= 0:
            return None
        active = sorted(set(range(self.num_layers)) - self.frozen)
        rng = np.random.default_rng([self.seed, self.windows_done])
        chosen = rng.choice(active, size=extra, replace=False)
        details = {"decision_index": self.windows_done, "bound": bound, "cap": self.max_frozen, "seed": self.seed}
        return self.frozen | frozenset(int(i) for i in chosen), details


class SchedulePolicy(FreezePolicy):
    """Explicit ``(at, frozen_count)`` pairs: once ``at`` steps (or epochs) are done, freeze that many first layers.

    An entry at 0 holds before the first step, as the prior does: its layers never take an update and never get
    optimizer state (``start_decision`` records it). ``max_fraction`` does not cap a schedule: the bound guards the
    policies that decide for themselves, and a schedule that froze fewer layers than it lists would be silently
    wrong (``[[0, 3]]`` of six layers is three at any ``max_fraction``)."""

    name = "schedule"

    def __init__(self, num_layers: int, *, schedule: Sequence[Sequence[int]], **common: Any) -> None:
        super().__init__(num_layers, **common)
        self.schedule = _validated_schedule(schedule, num_layers)
        at_start = max((count for at, count in self.schedule if at == 0), default=0)
        if at_start > len(self.frozen):
            self.frozen = frozenset(range(at_start))
            self.start_decision = FreezeDecision(self.frozen, step=0, epoch=0,
                                                 details={"at": 0, "scheduled": at_start})

    def _propose(self, window_end: bool) -> tuple[frozenset[int], dict[str, Any]] | None:
        progress = self.steps_done if self.interval_unit == "steps" else self.epochs_done
        due = [(at, count) for at, count in self.schedule if at <= progress]
        if not due:
            return None
        at, count = due[-1]
        return frozenset(range(count)), {"at": at, "scheduled": count}

    def outcome(self) -> str:
        """A schedule has no decision windows: say what it froze, or when its first entry was due."""
        if self.frozen:
            return f"{len(self.frozen)} of {self.num_layers} layers frozen by freeze.schedule"
        due = [at for at, count in self.schedule if count > 0]
        if not due:
            return "nothing froze: freeze.schedule freezes no layer"
        progress = self.steps_done if self.interval_unit == "steps" else self.epochs_done
        return (f"nothing froze: freeze.schedule's first freeze is due after {due[0]} {self.interval_unit}, "
                f"the run did {progress}")


class GradientPolicy(FreezePolicy):
    """AutoFreeze as the paper describes it: freeze the leading layers whose gradients stopped changing.

    Each window's mean gradient norm per active layer is compared with the previous window's:
    ratio ``|g_prev - g_cur| / g_prev``. The layers below the first active layer whose ratio reaches
    the ``percentile``-th percentile of the active layers' ratios freeze (a layer still changing a lot
    keeps itself and everything above it training, since its input must stay stable once cached).
    The count is then bounded by the run's learning-rate budget (``budget_layers``) and by ``max_fraction``
    when set. Means, not sums, so windows of unequal length (epochs) compare fairly.

    The percentile is relative: it always finds a "most converged" half, even in a model whose layers
    are all still moving (training from scratch). ``max_change`` adds an absolute test: a layer whose
    ratio is at or above it counts as changing whatever the percentile says (``None``: the paper's
    percentile alone).
    """

    name = "gradient"

    def __init__(self, num_layers: int, *, percentile: float, max_change: float | None,
                 evidence_max_fraction: float | None = None, **common: Any) -> None:
        super().__init__(num_layers, **common)
        self._cap_evidence(evidence_max_fraction)
        self.percentile = percentile
        self.max_change = max_change
        self.decisions = 0
        self.window_sum = np.zeros(num_layers, dtype=np.float64)
        self.window_steps = 0
        self.previous_mean: np.ndarray | None = None

    def observe(self, layer_grad_norms: Sequence[float], layer_grad_dots: Sequence[float | None] | None = None,
                layer_descents: Sequence[float | None] | None = None) -> None:
        super().observe(layer_grad_norms, layer_grad_dots, layer_descents)
        self.window_sum += np.asarray(layer_grad_norms, dtype=np.float64)
        self.window_steps += 1

    def windows_before_a_freeze(self, window_steps: int) -> int:
        return 2  # it compares two windows

    def _propose(self, window_end: bool) -> tuple[frozenset[int], dict[str, Any]] | None:
        if not window_end:
            return None
        if self.window_steps == 0:
            raise RuntimeError("the gradient freeze policy saw a window without observe() calls: call it every step")
        current = self.window_sum / self.window_steps
        previous = self.previous_mean
        self.previous_mean = current
        self.window_sum = np.zeros(self.num_layers, dtype=np.float64)
        self.window_steps = 0
        active = [i for i in range(self.num_layers) if i not in self.frozen]
        if previous is None or not active:
            return None
        self.decisions += 1
        ratios = {i: _change_ratio(float(previous[i]), float(current[i])) for i in active}
        # Infinite ratios (a layer whose gradient was 0 and is not) enter the percentile as the largest
        # float so interpolation stays finite; NaN norms (divergence) give a NaN threshold: nothing freezes.
        finite = np.minimum(np.fromiter(ratios.values(), dtype=np.float64), _LARGEST_FLOAT)
        threshold = float(np.percentile(finite, self.percentile))
        if self.max_change is not None:
            threshold = min(threshold, self.max_change)
        candidate = next((i for i in active if ratios[i] >= threshold), active[0])
        bound = self.budget()
        details = {
            "decision_index": self.decisions,
            "ratios": [ratios.get(i) for i in range(self.num_layers)],
            "threshold": threshold,
            "candidate": candidate,
            "bound": bound,
            "spent": self.spent_share(),
            "cap": self.max_frozen,
            "evidence_cap": self.evidence_cap,
        }
        return self._bounded_prefix(candidate, bound), details

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(
            decisions=self.decisions,
            window_sum=self.window_sum.tolist(),
            window_steps=self.window_steps,
            previous_mean=None if self.previous_mean is None else self.previous_mean.tolist(),
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.decisions = int(state["decisions"])
        self.window_sum = np.asarray(state["window_sum"], dtype=np.float64)
        self.window_steps = int(state["window_steps"])
        previous = state["previous_mean"]
        self.previous_mean = None if previous is None else np.asarray(previous, dtype=np.float64)


class CoherencePolicy(FreezePolicy):
    """Freeze the leading layers whose gradient has turned into noise.

    Per active layer and window, the gradient coherence ``C = sum_t g_t . g_{t-1} / sum_t ||g_t||^2`` over the
    window's steps. Consecutive mini-batches are independent, so ``E[g_t . g_{t-1}] = ||E g||^2`` while
    ``E ||g_t||^2 = ||E g||^2 + tr(Cov g)``: ``C`` estimates the share of the gradient's energy that is signal,
    1 when every step pushes the layer the same way and 0 (up to sampling noise) when its steps are a random
    walk around a minimum, where more training moves it without improving it. The ratio has no units, so
    one ``threshold`` means the same on every model, layer, task and learning rate, unlike a gradient norm or a
    relative percentile (which always finds a "converged" half).

    A layer has converged when the model has learned (a window in which some layer's coherence was at or above
    ``threshold``; see ``learned_by`` and ``learned_min_steps``) and the layer's coherence has then stayed below
    ``threshold`` for two consecutive windows. Low coherence before that means learning has not started (the first
    steps, with a random head and a learning rate near zero, look like noise too), and one window's estimate is noisy.
    The layers below the first active layer that has not converged freeze (a layer still learning keeps itself and
    everything above it training, since its input must stay fixed once cached). A window without a valid dot product for
    a layer (its previous gradient was lost, e.g. moved to another rank) counts as still learning. ``max_advance`` (1 by
    default) lets at most that many more layers freeze per decision, so each layer freezes on its own evidence, in a
    window of its own, while the layers above keep adapting. How deep the evidence may go is bounded by what the run
    has left: ``budget_layers`` of the learning rate spent, within ``evidence_max_fraction`` of the layers (the safety
    caps, counted together in ``cap_binds``), and by ``max_fraction`` when the user sets one. Every window records, per
    layer, why it froze or did not (``reasons``).

    ``learned_by`` says whose window of learning starts a layer's test: any layer's (``any_layer``, the default)
    or the layer's own (``layer``, the rule until 2026-11-26). Coherence rises and falls with the run's phase on
    every layer together, and a pretrained bottom layer may never carry a coherent gradient of its own, so waiting
    for its own window can mean it never freezes (debates in ``benchmarks/freeze_transfer``, one seed of the full
    text run in ``benchmarks/speedup``); once any layer has learned, the task's signal has reached the model and
    the first steps' noise is behind it.

    ``learned_min_steps`` is how many steps a layer's coherence must stay at or above ``threshold``, over consecutive
    windows, before it counts as having learned (1: any one window, the rule until 2026-11-27; the config's default is
    20, two windows of the 10-step floor). A coherence is an average over its window's steps, so on a short run, where
    every window is the floor, one window's value just above the threshold could start the test and freeze layers that
    were still needed (debates and Rotten Tomatoes in ``benchmarks/freeze_transfer``); a window as long as this counts
    alone.
    """

    name = "coherence"

    def __init__(self, num_layers: int, *, threshold: float, max_advance: int | None, learned_by: str,
                 learned_min_steps: int, evidence_max_fraction: float | None = None, **common: Any) -> None:
        super().__init__(num_layers, **common)
        self._cap_evidence(evidence_max_fraction)
        self.threshold = threshold
        self.max_advance = max_advance
        self.learned_by = learned_by
        self.learned_min_steps = learned_min_steps
        self.decisions = 0
        self.previous_coherence: list[float | None] = [None] * num_layers
        self.learned = [False] * num_layers  # coherence at or above the threshold for learned_min_steps was seen
        self.learned_earlier = [False] * num_layers  # ... before the last window that ended
        self.steps_above = [0] * num_layers  # steps of the consecutive windows, up to the last, at or above threshold
        self.steps_at_window_start = 0
        self._reset_window()

    def windows_before_a_freeze(self, window_steps: int) -> int:
        """The windows of learning (``learned_min_steps`` of steps), then two below the threshold."""
        return math.ceil(self.learned_min_steps / window_steps) + WINDOWS_BELOW

    def _reset_window(self) -> None:
        self.dot_sum = np.zeros(self.num_layers, dtype=np.float64)
        self.sq_sum = np.zeros(self.num_layers, dtype=np.float64)
        self.valid_steps = np.zeros(self.num_layers, dtype=np.int64)

    def observe(self, layer_grad_norms: Sequence[float], layer_grad_dots: Sequence[float | None] | None = None,
                layer_descents: Sequence[float | None] | None = None) -> None:
        super().observe(layer_grad_norms, layer_grad_dots, layer_descents)
        if layer_grad_dots is None:
            raise ValueError("the coherence freeze policy needs per-layer gradient dot products: pass layer_grad_dots "
                             "(replay: a run logged with this version's metrics)")
        for layer, (norm, dot) in enumerate(zip(layer_grad_norms, layer_grad_dots)):
            if dot is not None:
                self.dot_sum[layer] += dot
                self.sq_sum[layer] += float(norm) ** 2
                self.valid_steps[layer] += 1

    def window_coherence(self) -> list[float | None]:
        """Each layer's coherence over the window so far (``None`` without a valid step or gradient)."""
        return [float(self.dot_sum[i] / self.sq_sum[i]) if self.valid_steps[i] and self.sq_sum[i] > 0 else None
                for i in range(self.num_layers)]

    def _propose(self, window_end: bool) -> tuple[frozenset[int], dict[str, Any]] | None:
        if not window_end:
            return None
        coherence = self.window_coherence()
        previous, self.previous_coherence = self.previous_coherence, coherence
        self._reset_window()
        # learned before the previous window: the two windows tested below must both come after it
        learned_before = self.learned_earlier
        if self.learned_by == "any_layer":
            learned_before = [any(learned_before)] * self.num_layers
        self.learned_earlier = list(self.learned)
        window_steps, self.steps_at_window_start = self.steps_done - self.steps_at_window_start, self.steps_done
        self.steps_above = [above + window_steps if value is not None and value >= self.threshold else 0
                            for above, value in zip(self.steps_above, coherence)]
        self.learned = [seen or above >= self.learned_min_steps for seen, above in zip(self.learned, self.steps_above)]
        active = [i for i in range(self.num_layers) if i not in self.frozen]
        if not active:
            return None
        self.decisions += 1

        def converged(layer: int) -> bool:  # NaN (divergence) compares False: not converged
            return learned_before[layer] and all(value is not None and value < self.threshold
                                                 for value in (previous[layer], coherence[layer]))

        candidate = next((i for i in active if not converged(i)), self.num_layers)
        bound = self.budget()
        details = {"decision_index": self.decisions, "coherence": coherence, "previous_coherence": previous,
                   "threshold": self.threshold, "candidate": candidate, "bound": bound, "spent": self.spent_share(),
                   "cap": self.max_frozen, "evidence_cap": self.evidence_cap}
        advance_limit = self.num_layers
        if self.max_advance is not None:
            advance_limit = details["advance_limit"] = frozen_prefix_layers(self.frozen) + self.max_advance
        target = self._bounded_prefix(min(candidate, advance_limit), bound)
        learned_by_now = self.learned_earlier if self.learned_by == "layer" else [any(self.learned_earlier)] * self.num_layers
        details["reasons"] = self._reasons(target, candidate, converged, learned_by_now, coherence,
                                           holds={HELD_BY_EVIDENCE_CAP: self.evidence_cap, HELD_BY_BUDGET: bound,
                                                  HELD_BY_ADVANCE: advance_limit,
                                                  HELD_BY_MAX_FRACTION: self.max_frozen})
        return target, details

    def _reasons(self, target: frozenset[int], candidate: int, converged: Any, learned_by_now: list[bool],
                 coherence: list[float | None], holds: dict[str, int]) -> list[str]:
        """Why each layer is frozen or not after this window, one code per layer (``REASONS``)."""
        reasons = []
        for layer in range(self.num_layers):
            if layer in self.frozen:
                reasons.append(FROZEN_BEFORE)
            elif layer in target:
                reasons.append(FREEZES)
            elif layer < candidate:  # converged, held back by the first bound it exceeds
                reasons.append(next(code for code, limit in holds.items() if layer >= limit))
            elif converged(layer):
                reasons.append(ABOVE_LEARNING)
            elif coherence[layer] is None or not coherence[layer] < self.threshold:  # type: ignore[operator]
                reasons.append(LEARNING)
            else:
                reasons.append(ONE_WINDOW_BELOW if learned_by_now[layer] else NOT_LEARNED)
        return reasons

    def outcome(self) -> str:
        """Why nothing froze, in the test's terms: the bottom layer above the prior must converge first (freezing
        is a prefix)."""
        if len(self.frozen) > self.prior_layers or min(self.max_frozen, self.evidence_cap) <= self.prior_layers:
            return super().outcome()
        first = self.prior_layers  # the first layer the evidence must find converged
        if self.interval_unit == "steps":
            window_steps = self.interval
        else:  # epochs: the windows so far (a run shorter than one window has seen at most its steps)
            window_steps = self.steps_done // self.windows_done if self.windows_done else self.steps_done
        needed = self.windows_before_a_freeze(max(window_steps, 1))
        if self.windows_done < needed:
            learning = {1: "one", 2: "two"}.get(needed - WINDOWS_BELOW, str(needed - WINDOWS_BELOW))
            return (f"{super().outcome()}: the coherence test needs {needed} ({learning} to learn, two below the "
                    "threshold); shorten freeze.interval (or freeze.min_window_steps)")
        reached = f"reached {self.threshold}" + ("" if self.learned_min_steps == 1 else
                                                 f" over {self.learned_min_steps} steps in a row")
        if self.learned_by == "any_layer" and not any(self.learned):
            return (f"{super().outcome()}: no layer's gradient coherence ever {reached} (the model did "
                    "not start learning, or its gradients are mostly mini-batch noise)")
        if self.learned_by == "layer" and not self.learned[first]:
            return (f"{super().outcome()}: layer {first}'s gradient coherence never {reached} (it did not "
                    "start learning, or its gradient is mostly mini-batch noise), and a layer counts as converged only "
                    "after it learned (freeze.learned_by: any_layer starts its test once any layer has)")
        learned = f"layer {first} learned, but its" if self.learned_by == "layer" else \
            f"a layer learned, but layer {first}'s"
        return (f"{super().outcome()}: {learned} gradient coherence never stayed below {self.threshold} for two "
                "windows in a row")

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(decisions=self.decisions, dot_sum=self.dot_sum.tolist(), sq_sum=self.sq_sum.tolist(),
                     valid_steps=self.valid_steps.tolist(), previous_coherence=self.previous_coherence,
                     learned=self.learned, learned_earlier=self.learned_earlier, steps_above=self.steps_above,
                     steps_at_window_start=self.steps_at_window_start)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.decisions = int(state["decisions"])
        self.dot_sum = np.asarray(state["dot_sum"], dtype=np.float64)
        self.sq_sum = np.asarray(state["sq_sum"], dtype=np.float64)
        self.valid_steps = np.asarray(state["valid_steps"], dtype=np.int64)
        self.previous_coherence = list(state["previous_coherence"])
        self.learned = [bool(seen) for seen in state["learned"]]
        # absent from checkpoints of earlier versions, whose test read ``learned``: the same decisions for learned_by
        # layer (a layer that learned in the previous window was not below the threshold in it)
        self.learned_earlier = [bool(seen) for seen in state.get("learned_earlier", state["learned"])]
        # absent from checkpoints of earlier versions, which had learned_min_steps 1: ``learned`` already holds the rest
        self.steps_above = [int(count) for count in state.get("steps_above", [0] * self.num_layers)]
        self.steps_at_window_start = int(state.get("steps_at_window_start", self.steps_done))


class DescentPolicy(FreezePolicy):
    """Freeze the leading layers whose updates no longer lower the loss on new batches.

    Per step and active layer, the descent ``d_t = -g_t . (w_t - w_{t-1})``: the first-order change of this step's
    batch loss that the layer's previous update made, on a batch that update was not computed from (layer 0's counts
    the embeddings, which freeze with it). Positive while the updates carry something that holds beyond their own
    batches; negative once they are a random walk around a minimum, whose steps raise a new batch's loss through
    the curvature. Per window, the t-statistic of the layer's mean descent ``T = mean(d) / (sd(d) / sqrt(n))``:
    the evidence grows with the window, so a small steady descent (slow learning that adds up over hundreds of steps)
    gives a large ``T`` while noise averages out. Unlike a gradient statistic, the descent counts what the optimizer
    actually did with the gradient (its learning rate, per-layer scale and preconditioning), which is what freezing
    takes away.

    A layer has stopped learning when its ``T`` stays below ``threshold`` for two consecutive windows, after the model
    has learned (a window in which some layer's ``T`` reached ``LEARNING_T``: the first steps, with a random head and
    a learning rate near zero, say nothing). The layers below the first active layer that has not stopped freeze (a
    layer still learning keeps itself and everything above it training), at most ``max_advance`` more per window,
    within ``evidence_max_fraction`` of the layers (the top layers keep training) and ``max_fraction`` when set.
    The test says whether a layer still learns, not what freezing it costs, so the depth has its own bounds. With
    ``jitter_max_share``, the frozen prefix holds at most that share of the model's jitter: per layer ``-mean(d)``
    (at least 0), the loss its random walk adds on new batches, which freezing locks in and annealing would remove,
    taken from the window before the first freeze (afterwards the active layers' jitter answers to the freeze). With
    ``early_max_fraction``, only that share of the layers freezes whenever the test allows, deeper layers within the
    learning-rate budget (``budget_layers``). Every window records each layer's ``T`` and jitter and, per layer, why it
    froze or did not (``reasons``).
    """

    name = "descent"

    def __init__(self, num_layers: int, *, threshold: float, max_advance: int | None,
                 evidence_max_fraction: float | None = None, early_max_fraction: float | None = None,
                 jitter_max_share: float | None = None, **common: Any) -> None:
        super().__init__(num_layers, **common)
        self._cap_evidence(evidence_max_fraction)
        # layers the test may freeze whenever it finds them stopped; deeper ones wait for the learning-rate budget
        self.early_cap = (None if early_max_fraction is None else
                          max(self.prior_layers, math.floor(early_max_fraction * num_layers + _FLOAT_SLACK)))
        self.threshold = threshold
        self.max_advance = max_advance
        self.decisions = 0
        self.windows_below = [0] * num_layers  # consecutive windows, up to the last, with T below the threshold
        self.learned = False  # some layer's T reached LEARNING_T in a window that ended
        self.previous_t: list[float | None] = [None] * num_layers
        self.jitter_max_share = jitter_max_share
        # per layer, the loss its own updates added on new batches (-mean descent, at least 0) in the last window
        # before the first freeze: once layers freeze, the others' jitter answers to the freeze, not to where the
        # model's jitter sat
        self.jitter = [0.0] * num_layers
        self.jitter_held = False  # the jitter bound held back layers the test found stopped
        self._reset_window()

    def windows_before_a_freeze(self, window_steps: int) -> int:
        """One window of learning, then two below the threshold."""
        return 1 + WINDOWS_BELOW

    def _reset_window(self) -> None:
        self.descent_sum = np.zeros(self.num_layers, dtype=np.float64)
        self.descent_sq_sum = np.zeros(self.num_layers, dtype=np.float64)
        self.valid_steps = np.zeros(self.num_layers, dtype=np.int64)

    def observe(self, layer_grad_norms: Sequence[float], layer_grad_dots: Sequence[float | None] | None = None,
                layer_descents: Sequence[float | None] | None = None) -> None:
        super().observe(layer_grad_norms, layer_grad_dots, layer_descents)
        if layer_descents is None:
            raise ValueError("the descent freeze policy needs per-layer descents: pass layer_descents (replay: a run "
                             "logged with run.log_every: 1 by this version)")
        for layer, descent in enumerate(layer_descents):
            if descent is not None:
                self.descent_sum[layer] += descent
                self.descent_sq_sum[layer] += descent * descent
                self.valid_steps[layer] += 1

    def window_t(self) -> list[float | None]:
        """Each layer's descent t-statistic over the window so far (``None`` with fewer than two valid steps; 0 when
        every step's descent was the same, e.g. zero)."""
        values: list[float | None] = []
        for total, squares, count in zip(self.descent_sum, self.descent_sq_sum, self.valid_steps):
            if count < 2:
                values.append(None)
                continue
            mean = total / count
            variance = max(squares - count * mean * mean, 0.0) / (count - 1)
            values.append(float(mean / math.sqrt(variance / count)) if variance > 0 else 0.0)
        return values

    def _propose(self, window_end: bool) -> tuple[frozenset[int], dict[str, Any]] | None:
        if not window_end:
            return None
        t_values = self.window_t()
        self.previous_t = t_values
        if len(self.frozen) <= self.prior_layers:
            self.jitter = [max(0.0, -float(total) / int(count)) if count > 0 else 0.0
                           for total, count in zip(self.descent_sum, self.valid_steps)]
        self._reset_window()
        learned_before = self.learned
        self.learned = learned_before or any(t is not None and t >= LEARNING_T for t in t_values)
        # NaN (divergence) compares False: not below, so the layer keeps training
        self.windows_below = [below + 1 if t is not None and t < self.threshold else 0
                              for below, t in zip(self.windows_below, t_values)]
        active = [i for i in range(self.num_layers) if i not in self.frozen]
        if not active:
            return None
        self.decisions += 1

        def stopped(layer: int) -> bool:
            return learned_before and self.windows_below[layer] >= WINDOWS_BELOW

        candidate = next((i for i in active if not stopped(i)), self.num_layers)
        bound = min(self.num_layers, self.evidence_cap)
        budget_limit = self.num_layers
        if self.early_cap is not None:
            budget_limit = max(self.early_cap, self.budget())
            bound = min(bound, budget_limit)
        jitter_limit = self.num_layers
        if self.jitter_max_share is not None:
            jitter_limit = self.jitter_prefix(self.jitter_max_share)
            bound = min(bound, jitter_limit)
        advance_limit = self.num_layers
        details: dict[str, Any] = {"decision_index": self.decisions, "descent_t": t_values, "jitter": list(self.jitter),
                                   "threshold": self.threshold, "candidate": candidate, "bound": bound,
                                   "spent": self.spent_share(), "cap": self.max_frozen,
                                   "evidence_cap": self.evidence_cap, "early_cap": self.early_cap}
        if self.max_advance is not None:
            advance_limit = details["advance_limit"] = frozen_prefix_layers(self.frozen) + self.max_advance
        target = self._bounded_prefix(min(candidate, advance_limit), bound)
        self.jitter_held = self.jitter_held or min(candidate, advance_limit, self.evidence_cap) > jitter_limit
        holds = {HELD_BY_EVIDENCE_CAP: self.evidence_cap, HELD_BY_JITTER: jitter_limit, HELD_BY_BUDGET: budget_limit,
                 HELD_BY_ADVANCE: advance_limit, HELD_BY_MAX_FRACTION: self.max_frozen}
        reasons = []
        for layer, t in enumerate(t_values):
            if layer in self.frozen:
                reasons.append(FROZEN_BEFORE)
            elif layer in target:
                reasons.append(FREEZES)
            elif layer < candidate:  # stopped, held back by the first bound it exceeds
                reasons.append(next(code for code, limit in holds.items() if layer >= limit))
            elif stopped(layer):
                reasons.append(ABOVE_LEARNING)
            elif t is None or not t < self.threshold:
                reasons.append(DESCENDING)
            else:
                reasons.append(ONE_WINDOW_BELOW if learned_before else NOT_LEARNED)
        details["reasons"] = reasons
        return target, details

    def jitter_prefix(self, max_share: float) -> int:
        """The most leading layers whose jitter is at most ``max_share`` of every layer's together (all of them when
        no layer has any: nothing to lock in)."""
        total = sum(self.jitter)
        if total <= 0.0:
            return self.num_layers
        held = 0.0
        for layer, value in enumerate(self.jitter):
            held += value
            if held > max_share * total * (1.0 + _FLOAT_SLACK):
                return layer
        return self.num_layers

    def outcome(self) -> str:
        """Why nothing froze, in the test's terms: the bottom layer above the prior must stop descending first."""
        if len(self.frozen) > self.prior_layers or min(self.max_frozen, self.evidence_cap) <= self.prior_layers:
            return super().outcome()
        needed = self.windows_before_a_freeze(1)
        if self.windows_done < needed:
            return (f"{super().outcome()}: the descent test needs {needed} windows (one to learn, two below the "
                    "threshold); shorten freeze.interval (or freeze.min_window_steps)")
        if not self.learned:
            return (f"{super().outcome()}: no layer's descent t ever reached {LEARNING_T} (the model did not start "
                    "learning, or its updates are mostly noise)")
        if self.jitter_held:
            return (f"{super().outcome()}: layer {self.prior_layers} stopped learning but held more than "
                    f"{self.jitter_max_share} of the model's jitter (freeze.jitter_max_share)")
        return (f"{super().outcome()}: layer {self.prior_layers}'s updates kept lowering the loss on new batches "
                f"(its descent t never stayed below {self.threshold} for two windows in a row)")

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(decisions=self.decisions, descent_sum=self.descent_sum.tolist(),
                     descent_sq_sum=self.descent_sq_sum.tolist(), valid_steps=self.valid_steps.tolist(),
                     windows_below=self.windows_below, learned=self.learned, previous_t=self.previous_t,
                     jitter=self.jitter, jitter_held=self.jitter_held)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.decisions = int(state["decisions"])
        self.descent_sum = np.asarray(state["descent_sum"], dtype=np.float64)
        self.descent_sq_sum = np.asarray(state["descent_sq_sum"], dtype=np.float64)
        self.valid_steps = np.asarray(state["valid_steps"], dtype=np.int64)
        self.windows_below = [int(count) for count in state["windows_below"]]
        self.learned = bool(state["learned"])
        self.previous_t = list(state["previous_t"])
        # absent from checkpoints of earlier versions, which had no jitter bound
        self.jitter = [float(value) for value in state.get("jitter", [0.0] * self.num_layers)]
        self.jitter_held = bool(state.get("jitter_held", False))


def _change_ratio(previous: float, current: float) -> float:
    """``|g_prev - g_cur| / g_prev``; a layer with no gradient in both windows has not changed at all."""
    if previous == 0.0:
        return 0.0 if current == 0.0 else math.inf
    return abs(previous - current) / previous


def _validated_schedule(schedule: Sequence[Sequence[int]], num_layers: int) -> list[tuple[int, int]]:
    pairs: list[tuple[int, int]] = []
    for entry in schedule:
        if len(entry) != 2:
            raise ValueError(f"freeze.schedule entries are [at, frozen_layers] pairs, got {list(entry)}")
        at, count = int(entry[0]), int(entry[1])
        if at < 0 or not 0 <= count <= num_layers:
            raise ValueError(
                f"freeze.schedule entry [{at}, {count}] needs at >= 0 and 0 <= frozen_layers <= {num_layers}"
            )
        if pairs and (at <= pairs[-1][0] or count < pairs[-1][1]):
            raise ValueError(
                f"freeze.schedule must be monotone (at increasing, frozen_layers never decreasing): "
                f"[{pairs[-1][0]}, {pairs[-1][1]}] is followed by [{at}, {count}]"
            )
        pairs.append((at, count))
    return pairs


def make_policy(
    name: str,
    num_layers: int,
    *,
    interval: int,
    interval_unit: str,
    seed: int,
    alpha: float = FreezeConfig.alpha,
    percentile: float = FreezeConfig.percentile,
    max_fraction: float | None = FreezeConfig.max_fraction,
    evidence_max_fraction: float | None = FreezeConfig.evidence_max_fraction,
    schedule: Sequence[Sequence[int]] | None = None,
    max_change: float | None = FreezeConfig.max_change,
    threshold: float = FreezeConfig.threshold,
    max_advance: int | None = FreezeConfig.max_advance,
    learned_by: str = FreezeConfig.learned_by,
    learned_min_steps: int = FreezeConfig.learned_min_steps,
    descent_threshold: float = FreezeConfig.descent_threshold,
    early_max_fraction: float | None = FreezeConfig.early_max_fraction,
    jitter_max_share: float | None = FreezeConfig.jitter_max_share,
    prior_layers: int = 0,
    spent: Sequence[float] | None = None,
) -> FreezePolicy:
    """Build a policy by its config name, checking every argument with an error that says what to set.

    The defaults are ``FreezeConfig``'s (its fields own them). ``interval`` counts steps or epochs here: a
    ``fraction`` of the run is turned into steps by :func:`window_steps` first (``policy_from_settings`` does).
    ``prior_layers`` start frozen; ``spent`` (:func:`spent_shares` of the run's learning rates) bounds the
    evidence policies, which without it are bounded only by ``max_fraction``.
    """
    if name not in POLICY_NAMES:
        raise ValueError(f"unknown freeze policy {name!r}: set freeze.policy to one of {', '.join(POLICY_NAMES)}")
    if num_layers < 1:
        raise ValueError(f"a freeze policy needs at least one layer, got num_layers={num_layers}")
    if interval < 1:
        raise ValueError(f"freeze.interval must be >= 1, got {interval}")
    if interval_unit not in INTERVAL_UNITS[:2]:
        raise ValueError(f"freeze.interval_unit must be one of {', '.join(INTERVAL_UNITS[:2])} here (turn a fraction "
                         f"into steps with window_steps first), got {interval_unit!r}")
    check_freeze_values(alpha=alpha, percentile=percentile, max_fraction=max_fraction,
                        evidence_max_fraction=evidence_max_fraction, max_change=max_change, threshold=threshold,
                        max_advance=max_advance, learned_by=learned_by, learned_min_steps=learned_min_steps,
                        descent_threshold=descent_threshold, early_max_fraction=early_max_fraction,
                        jitter_max_share=jitter_max_share)
    if name == "schedule" and not schedule:
        raise ValueError("freeze.policy=schedule needs freeze.schedule: [[at, frozen_layers], ...]")
    if not 0 <= prior_layers < num_layers:
        raise ValueError(f"prior_layers must be in 0..{num_layers - 1}, got {prior_layers}")
    common: dict[str, Any] = {"interval": interval, "interval_unit": interval_unit, "max_fraction": max_fraction,
                              "prior_layers": prior_layers, "spent": spent}
    if name == "descent":
        return DescentPolicy(num_layers, threshold=descent_threshold, max_advance=max_advance,
                             evidence_max_fraction=evidence_max_fraction, early_max_fraction=early_max_fraction,
                             jitter_max_share=jitter_max_share, **common)
    if name == "coherence":
        return CoherencePolicy(num_layers, threshold=threshold, max_advance=max_advance, learned_by=learned_by,
                               learned_min_steps=learned_min_steps, evidence_max_fraction=evidence_max_fraction,
                               **common)
    if name == "gradient":
        return GradientPolicy(num_layers, percentile=percentile, max_change=max_change,
                              evidence_max_fraction=evidence_max_fraction, **common)
    if name == "geometric":
        return GeometricPolicy(num_layers, alpha=alpha, **common)
    if name == "random":
        return RandomPolicy(num_layers, alpha=alpha, seed=seed, **common)
    if name == "schedule":
        return SchedulePolicy(num_layers, schedule=schedule or [], **common)
    return NoFreezePolicy(num_layers, **common)


def window_steps(fraction: float, total_steps: int, min_steps: int) -> int:
    """Steps per decision window for ``interval_unit: fraction``: that share of the planned steps, at least
    ``min_steps`` (a window of a handful of steps measures noise, not convergence)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"freeze.interval must be in (0, 1] with interval_unit: fraction, got {fraction}")
    return max(min_steps, round(fraction * total_steps), 1)


def policy_from_settings(settings: FreezeConfig, num_layers: int, *, seed: int, total_steps: int,
                         enabled: bool = True, prior_layers: int = 0,
                         learning_rates: Sequence[float] | None = None) -> FreezePolicy:
    """``make_policy`` from the ``freeze`` section of a config.

    ``total_steps`` (the run's planned optimizer steps) turns ``interval_unit: fraction`` into a window in
    steps. ``learning_rates`` (one per step the run will take) set the evidence policies' budget; without them the
    rate is taken as constant over ``total_steps``. ``enabled=False`` gives the ``none`` policy, so a run without
    AutoFreeze still counts steps and windows.
    """
    name = settings.policy if enabled else "none"
    interval, unit = settings.interval, settings.interval_unit
    if name in UNWINDOWED:
        interval, unit = 1, "epochs" if unit == "epochs" else "steps"  # a schedule counts steps or epochs
    elif unit == "fraction":
        interval, unit = window_steps(interval, total_steps, settings.min_window_steps), "steps"
    rates = learning_rates if learning_rates is not None else [1.0] * total_steps
    return make_policy(name, num_layers, interval=int(interval),
                       interval_unit=unit, alpha=settings.alpha, percentile=settings.percentile,
                       max_fraction=settings.max_fraction, evidence_max_fraction=settings.evidence_max_fraction,
                       schedule=settings.schedule,
                       max_change=settings.max_change, threshold=settings.threshold,
                       max_advance=settings.max_advance, learned_by=settings.learned_by,
                       learned_min_steps=settings.learned_min_steps, descent_threshold=settings.descent_threshold,
                       early_max_fraction=settings.early_max_fraction,
                       jitter_max_share=settings.jitter_max_share, seed=seed,
                       prior_layers=prior_layers if enabled else 0, spent=spent_shares(rates))
