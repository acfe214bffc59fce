"""Each freeze criterion's decisions on gradient traces recorded from real runs (``tests/data``).

MiniLM fine-tuned on Rotten Tomatoes with plain data parallelism, 2,000 (and 1,000) training snippets for
3 epochs, every step logged (``run.log_every: 1``): per-layer gradient norms and dot products of consecutive
gradients, with the validation accuracy at every evaluation. A baseline froze nothing, so replaying it through
a policy gives that policy's decisions up to its first freeze exactly (later gradients would depend on it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipetransformer.config import FreezeConfig, TrainConfig
from pipetransformer.freeze.policies import (FreezeDecision, FreezePolicy, budget_layers, policy_from_settings,
                                             spent_shares)
from pipetransformer.freeze.replay import LoggedStep, read_logged_steps, replay
from pipetransformer.optim import lr_at

DATA = Path(__file__).resolve().parents[1] / "data"
TRACES = {"2000x3": "rotten_tomatoes_2000x3_ddp.jsonl", "1000x3": "rotten_tomatoes_1000x3_ddp.jsonl"}
NUM_LAYERS = 6


def trace(name: str) -> list[LoggedStep]:
    return read_logged_steps(DATA / TRACES[name])


def replayed(settings: FreezeConfig, steps: list[LoggedStep]) -> FreezePolicy:
    """The policy of these settings for a run of these steps, under the recorded runs' learning-rate schedule
    (linear decay after 6% warm-up: ``TrainConfig``'s)."""
    rates = [lr_at(step, len(steps), TrainConfig()) for step in range(len(steps))]
    return policy_from_settings(settings, NUM_LAYERS, seed=0, total_steps=len(steps), learning_rates=rates)


def first_decision(settings: FreezeConfig, steps: list[LoggedStep]) -> FreezeDecision | None:
    decisions = replay(replayed(settings, steps), steps)
    return decisions[0] if decisions else None


def first_epoch_end(steps: list[LoggedStep]) -> int:
    return next(s.step for s, following in zip(steps, steps[1:]) if following.epoch != s.epoch)


COHERENCE = FreezeConfig(enabled=True, policy="coherence", max_advance=1)
"""The coherence test as it was the default until 2026-12-04 (one more layer per window)."""
DEFAULT_DECISIONS = {"2000x3": [(70, 1), (80, 2), (110, 3)], "1000x3": [(60, 1), (70, 2), (80, 3)]}
"""The coherence test's decisions (``learned_by: any_layer``, ``learned_min_steps: 20``, one layer per window, the
learning-rate budget), exact up to the first (a replay of a run that froze nothing): on the 2,000-snippet trace the
upper layers pass 0.2 in the first 10-step window; with ``learned_min_steps: 1`` (the rule until 2026-11-27) that window
alone started the test and layer 0, below 0.2 in windows 2-3, froze at step 30, inside the first epoch. With 20 steps
of learning the test starts after window 2, layer 0's window 4 (coherence 0.62) keeps it learning, and layer 0
freezes at step 70 (58% of the learning rate spent), one more layer in each window its evidence and the budget allow,
up to half the layers (``evidence_max_fraction``; without it the 2,000-snippet trace went on to 4 at step 150 and 5 at
160). Until 2026-11-27 ``max_fraction`` 1/3 stopped every run at two layers. (A run with pretrained weights also starts
from the prior; a replay tests the evidence alone.)"""


@pytest.mark.parametrize("name", TRACES)
def test_coherence_waits_for_convergence_then_freezes_one_layer_at_a_time_within_the_budget(name: str) -> None:
    steps = trace(name)
    decision = first_decision(COHERENCE, steps)
    assert decision is not None
    # Not before two windows of learning and two below the threshold after them: the fourth window at the earliest.
    assert decision.details["decision_index"] >= 4
    policy = replayed(COHERENCE, steps)
    decisions = replay(policy, steps)
    spent = spent_shares([lr_at(step, len(steps), TrainConfig()) for step in range(len(steps))])
    for previous, current in zip([frozenset(), *(d.frozen for d in decisions)], (d.frozen for d in decisions)):
        assert current == frozenset(range(len(current))) and len(current) == len(previous) + 1  # a prefix, one more
    for d in decisions:
        cap = d.details["evidence_cap"]
        assert cap == NUM_LAYERS // 2
        assert len(d.frozen) <= min(budget_layers(NUM_LAYERS, 0, spent[d.step - 1]), cap) == d.details["bound"]
        assert d.details["reasons"][len(d.frozen) - 1] == "freezes"
    assert [(d.step, len(d.frozen)) for d in decisions] == DEFAULT_DECISIONS[name]
    own = replayed(FreezeConfig(enabled=True, policy="coherence", max_advance=1, learned_by="layer", learned_min_steps=1), steps)
    first_own = replay(own, steps)[0]
    assert first_own.step > first_epoch_end(steps)  # the earlier rule waited out the first epoch on both traces


def test_learning_that_lasts_one_window_started_the_test_in_the_warm_up() -> None:
    """With ``learned_min_steps: 1`` (the rule until 2026-11-27) the 2,000-snippet trace's first 10-step window started
    the test, and layer 0 froze at step 30; on the 1,000-snippet trace both rules decide alike."""
    for name, first in (("2000x3", (30, 1)), ("1000x3", DEFAULT_DECISIONS["1000x3"][0])):
        steps = trace(name)
        decision = first_decision(FreezeConfig(enabled=True, policy="coherence", max_advance=1, learned_min_steps=1),
                                  steps)
        assert decision is not None and (decision.step, len(decision.frozen)) == first, name


PAPER = FreezeConfig(enabled=True, policy="gradient", interval=0.05, interval_unit="fraction", min_window_steps=10,
                     percentile=50.0, max_advance=None, evidence_max_fraction=None)  # as many layers as converged:
# the criteria are under test
CRITERIA = {
    "paper": PAPER,  # the relative percentile of the gradient-norm change
    "paper+floor": FreezeConfig(**{**PAPER.__dict__, "max_change": 0.1}),  # ... plus an absolute floor
    "coherence": FreezeConfig(**{**PAPER.__dict__, "policy": "coherence", "threshold": 0.2}),
    "coherence (own)": FreezeConfig(**{**PAPER.__dict__, "policy": "coherence", "threshold": 0.2,
                                       "learned_by": "layer", "learned_min_steps": 1}),  # the rule before 2026-11-26
}
EXPECTED = {  # (step, frozen layers) of every decision a replay takes, exact up to the first
    ("2000x3", "paper"): [(40, 1), (60, 3), (110, 4), (140, 5)],
    ("2000x3", "paper+floor"): [(100, 2), (110, 3), (130, 4)],
    ("2000x3", "coherence"): [(70, 3), (110, 4), (150, 5)],  # the budget holds the fourth layer until 81% is spent
    ("2000x3", "coherence (own)"): [(70, 3), (110, 4), (150, 5)],
    ("1000x3", "paper"): [(50, 3), (80, 4), (90, 5)],
    ("1000x3", "paper+floor"): [(50, 3), (80, 4), (90, 5)],
    ("1000x3", "coherence"): [(60, 1), (70, 5)],
    ("1000x3", "coherence (own)"): [(60, 1), (70, 5)],
}


@pytest.mark.parametrize(("name", "criterion"), EXPECTED)
def test_each_criterions_decisions_on_the_recorded_traces(name: str, criterion: str) -> None:
    steps = trace(name)
    policy = replayed(CRITERIA[criterion], steps)
    decisions = replay(policy, steps)
    assert [(d.step, len(d.frozen)) for d in decisions] == EXPECTED[(name, criterion)]


def test_the_papers_percentile_freezes_while_every_layer_learns_most() -> None:
    """Its threshold is a percentile of the layers' own ratios, so some layer always falls below it: on the
    2,000-snippet trace it freezes layer 0 at step 40, after the window where every layer's gradient coherence
    peaks (0.62-0.74) and 35 steps before validation accuracy jumps from 0.73 to 0.79."""
    steps = trace("2000x3")
    decision = first_decision(PAPER, steps)
    assert decision is not None and (decision.step, sorted(decision.frozen)) == (40, [0])
    coherence = replayed(CRITERIA["coherence"], steps)
    replay(coherence, steps[:40])
    assert all(c is not None and c > 0.6 for c in coherence.previous_coherence)


def test_coherence_needs_the_model_to_have_learned_first() -> None:
    """In the first windows the bottom layers' coherence is low because they have not started learning. With
    ``learned_by: layer`` nothing freezes there; with ``any_layer`` and ``learned_min_steps: 1`` (the rule of
    2026-11-26), the upper layers' first window starts the test, and layer 0 freezes after two windows below 0.2 (step
    30); with the default's 20 steps of learning the test starts a window later, and nothing has frozen by step 30."""
    steps = trace("2000x3")
    for learned_by, learned_min_steps, frozen in (("layer", 1, frozenset()), ("any_layer", 1, frozenset({0})),
                                                  ("any_layer", 20, frozenset())):
        settings = FreezeConfig(enabled=True, policy="coherence", interval=10, interval_unit="steps",
                                threshold=0.2, max_advance=None, learned_by=learned_by,
                                learned_min_steps=learned_min_steps)
        policy = replayed(settings, steps)
        replay(policy, steps[:30])
        assert policy.frozen == frozen, learned_by
        assert policy.previous_coherence[0] is not None and policy.previous_coherence[0] < settings.threshold
        assert not policy.learned[0] and policy.learned[4]


DESCENT_TRACES = {"text": "rotten_tomatoes_2000x3_split53_ddp.jsonl", "image": "fashion_mnist_24000x3_split53_ddp.jsonl"}
"""Two plain runs (`ddp` on 2 workers, nothing frozen, every step logged: norms, dot products of consecutive gradients
and descents) on development rows (split 53): MiniLM on 2,000 Rotten Tomatoes snippets x 3 epochs (189 steps), where
every frozen layer cost accuracy in the frontier, and the masked-patch-pretrained 6-layer ViT on 24,000 Fashion-MNIST
images x 3 (564 steps), where freezing a third to a half of the layers was nearly free."""


def descent_trace(kind: str) -> list[LoggedStep]:
    return read_logged_steps(DATA / DESCENT_TRACES[kind])


def test_the_descent_test_holds_back_on_text_and_freezes_on_images() -> None:
    """The package's default on the recorded traces, exact up to the first freeze (a replay of a run that froze
    nothing): on the text trace every layer's updates keep lowering new batches' loss in some window of every pair
    (nothing freezes); on the image trace they raise it from the second window on, layer 0 freezes within the first
    sixth of the run and layer 1 joins it; the third would bring the frozen prefix above half the model's jitter
    (1.51, 0.66, 1.17, ... x 1e-3 of loss in the window before the first freeze), so it stops at two, where the
    half-depth cap alone froze three."""
    text = descent_trace("text")
    assert replay(replayed(FreezeConfig(enabled=True), text), text) == []
    image = descent_trace("image")
    decisions = replay(replayed(FreezeConfig(enabled=True), image), image)
    assert decisions and len(decisions[-1].frozen) == 2
    assert decisions[0].step <= len(image) // 6
    uncapped = replay(replayed(FreezeConfig(enabled=True, jitter_max_share=None), image), image)
    assert len(uncapped[-1].frozen) == NUM_LAYERS // 2
    assert all(t < FreezeConfig.descent_threshold for t in decisions[0].details["descent_t"][:len(decisions[0].frozen)])


DEEP_TRACE = "vit12_24000x3_split54_single.jsonl"
"""A plain run (one worker, nothing frozen, every step logged) of the 12-layer ViT, pretrained as the 6-layer one, on
the same 24,000 images x 3 (split 54, development rows): freezing half of its layers was free in the frontier, where
on the 6-layer ViT a third layer cost 0.4-0.5 points."""


def test_the_jitter_bound_freezes_as_deep_as_the_jitter_is_low() -> None:
    """Where the model's jitter (each layer's loss rise from its own updates) sits sets the depth: on the 6-layer
    trace it is spread over every layer and the bound stops at two, on the 12-layer one it sits on the top layers and
    the bottom half freezes whole (the half-depth cap binds first)."""
    deep = read_logged_steps(DATA / DEEP_TRACE)
    layers = len(deep[0].layer_grad_norms)
    rates = [lr_at(step, len(deep), TrainConfig()) for step in range(len(deep))]
    policy = policy_from_settings(FreezeConfig(enabled=True), layers, seed=0, total_steps=len(deep),
                                  learning_rates=rates)
    decisions = replay(policy, deep)
    assert layers == 12 and decisions and len(decisions[0].frozen) == layers // 2
    shallow = descent_trace("image")
    assert len(replay(replayed(FreezeConfig(enabled=True), shallow), shallow)[-1].frozen) == 2


def test_the_coherence_test_cannot_tell_the_two_traces_apart() -> None:
    """The baseline the descent test replaced, on the same traces: it freezes on both (its values are alike on text
    and images), the text trace included, where every frozen layer cost accuracy."""
    for kind in DESCENT_TRACES:
        steps = descent_trace(kind)
        assert replay(replayed(COHERENCE, steps), steps), kind
