"""Freeze policies on synthetic gradient traces: what freezes when, and the guarantees every policy keeps."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetransformer.config import FreezeConfig
from pipetransformer.freeze.policies import (
    POLICY_NAMES,
    FreezeDecision,
    FreezePolicy,
    frozen_blocks,
    frozen_prefix_layers,
    geometric_frozen_count,
    make_policy,
    policy_from_settings,
    window_steps,
)

NUM_LAYERS = 6
DECIDING_POLICIES = tuple(name for name in POLICY_NAMES if name != "schedule")
"""The policies ``max_fraction`` caps: all but the explicit schedule."""
DEFAULTS: dict[str, Any] = {
    "interval": 1,
    "interval_unit": "steps",
    "alpha": 0.25,
    "percentile": 50.0,
    "max_fraction": 1.0,
    "evidence_max_fraction": None,
    "jitter_max_share": None,
    "schedule": None,
    "max_change": None,
    "threshold": 0.1,
    "max_advance": None,
    "learned_min_steps": 1,
    "seed": 0,
}
"""The synthetic traces' settings: every layer may freeze at once, and one window of learning starts the test
(the package defaults, pinned in ``test_the_python_api_and_the_cli_build_the_same_default_freezer``, differ)."""


def build(name: str, num_layers: int = NUM_LAYERS, **overrides: Any) -> FreezePolicy:
    return make_policy(name, num_layers, **{**DEFAULTS, **overrides})


STEPS_PER_CONVERGED_LAYER = 6
LEARNING_COHERENCE = 0.6
CONVERGED_COHERENCE = 0.02


def converging_dots(norms: Sequence[float], step: int) -> list[float]:
    """Dot products of consecutive gradients for a trace where one more bottom layer turns to noise
    (coherence 0.02) every 6 steps, while the others keep a coherence of 0.6."""
    converged = step // STEPS_PER_CONVERGED_LAYER
    return [n * n * (CONVERGED_COHERENCE if layer < converged else LEARNING_COHERENCE)
            for layer, n in enumerate(norms)]


LEARNING_DESCENT = 1.0
CONVERGED_DESCENT = -0.2
DESCENT_NOISE = 0.05


def converging_descents(step: int, num_layers: int = NUM_LAYERS) -> list[float]:
    """Descents for the same trace: a converged layer's updates raise a new batch's loss a little (-0.2), a learning
    layer's lower it (1.0), each with an alternating +-0.05 so a window of two steps or more has a spread."""
    converged = step // STEPS_PER_CONVERGED_LAYER
    noise = DESCENT_NOISE if step % 2 else -DESCENT_NOISE
    return [(CONVERGED_DESCENT if layer < converged else LEARNING_DESCENT) + noise for layer in range(num_layers)]


def run(
    policy: FreezePolicy, trace: Sequence[Sequence[float]], steps_per_epoch: int = 1, start: int = 0,
    dots: Sequence[Sequence[float | None]] | None = None,
) -> list[FreezeDecision | None]:
    """Feed one row of gradient norms (and dot products: ``converging_dots`` unless given, and
    ``converging_descents``) per step; return the decision after each step."""
    decisions = []
    for offset, norms in enumerate(trace):
        step = start + offset
        policy.observe(norms, converging_dots(norms, step) if dots is None else dots[offset],
                       converging_descents(step, len(norms)))
        decisions.append(policy.decide(step, step // steps_per_epoch, (step + 1) % steps_per_epoch == 0))
    return decisions


def frozen_counts(decisions: Sequence[FreezeDecision | None]) -> list[int]:
    counts, current = [], 0
    for decision in decisions:
        if decision is not None:
            current = len(decision.frozen)
        counts.append(current)
    return counts


def stable_bottom_trace(windows: int, stable: int, num_layers: int = NUM_LAYERS) -> list[list[float]]:
    """Layers below ``stable`` have constant norms; the others halve every window."""
    return [[1.0 if layer < stable else 0.5**window for layer in range(num_layers)] for window in range(windows)]


def test_geometric_freezes_round_l_times_one_minus_decay() -> None:
    # L = 6, alpha = 0.25: 6 (1 - 0.75^T) = 1.5, 2.625, 3.47, 4.10, 4.58, 4.93, 5.20, 5.40, 5.55
    assert [geometric_frozen_count(NUM_LAYERS, 0.25, t) for t in range(1, 10)] == [2, 3, 3, 4, 5, 5, 5, 5, 6]
    decisions = run(build("geometric"), [[1.0] * NUM_LAYERS] * 9)
    assert frozen_counts(decisions) == [2, 3, 3, 4, 5, 5, 5, 5, 6]
    assert all(d is None or d.frozen == frozenset(range(len(d.frozen))) for d in decisions)


def test_geometric_with_epoch_windows_decides_only_at_every_interval_th_epoch_end() -> None:
    policy = build("geometric", interval=2, interval_unit="epochs", max_fraction=0.84)
    decisions = run(policy, [[1.0] * NUM_LAYERS] * 12, steps_per_epoch=3)
    changed_at = [step for step, decision in enumerate(decisions) if decision is not None]
    assert changed_at == [5, 11]  # ends of epochs 2 and 4
    assert [len(decisions[step].frozen) for step in changed_at] == [2, 3]  # type: ignore[union-attr]
    assert decisions[5].epoch == 1 and decisions[5].step == 5  # type: ignore[union-attr]


def test_max_fraction_caps_every_policy() -> None:
    # Layers 0-3 stopped changing (ratios 0 0 0 0 .5 .5; the 75th percentile is .375), so the gradient
    # policy wants 4 layers; coherence wants the 3 whose gradients turned to noise by step 19; the others want all 6.
    # descent, deciding over windows of two steps (one step has no spread), wants the 2 whose descents stayed
    # negative for two windows after the first.
    trace = stable_bottom_trace(windows=20, stable=4)
    wanted = {"gradient": 4, "coherence": 19 // STEPS_PER_CONVERGED_LAYER, "descent": 2, "none": 0}
    for name in DECIDING_POLICIES:
        for max_fraction, cap in [(1 / 3, 2), (0.5, 3), (0.84, 5), (0.0, 0)]:
            policy = build(name, alpha=1.0, percentile=75.0, max_fraction=max_fraction,
                           interval=2 if name == "descent" else 1)
            counts = frozen_counts(run(policy, trace))
            assert max(counts) <= cap, (name, max_fraction)
            assert counts[-1] == min(cap, wanted.get(name, NUM_LAYERS)), (name, max_fraction)


def test_a_schedule_freezes_what_it_lists_at_any_max_fraction() -> None:
    """The bound guards the deciding policies; an explicit schedule capped by it would freeze fewer layers than
    the user wrote, without a word."""
    for max_fraction in (0.0, 1 / 3, 1.0):
        policy = build("schedule", max_fraction=max_fraction, schedule=[[1, 2], [3, NUM_LAYERS - 1]])
        most = NUM_LAYERS - 1
        assert frozen_counts(run(policy, [[1.0] * NUM_LAYERS] * 5)) == [2, 2, most, most, most], max_fraction


def test_gradient_freezes_the_layers_whose_norms_stopped_changing() -> None:
    decisions = run(build("gradient", alpha=1.0), stable_bottom_trace(windows=5, stable=3))
    assert decisions[0] is None  # one window: nothing to compare yet
    assert decisions[1] is not None and decisions[1].frozen == frozenset({0, 1, 2})
    details = decisions[1].details
    assert details["candidate"] == 3 and details["threshold"] == pytest.approx(0.25)
    assert details["ratios"] == pytest.approx([0.0, 0.0, 0.0, 0.5, 0.5, 0.5])
    json.dumps(details)
    assert decisions[2:] == [None, None, None]


def test_gradient_is_bounded_by_the_learning_rate_budget() -> None:
    # a fifth of the learning rate spent per window: at most floor(6 * spent) layers, 1, 2, 3, 4, 6
    policy = build("gradient", spent=[0.2, 0.4, 0.6, 0.8, 1.0])
    decisions = run(policy, stable_bottom_trace(windows=5, stable=3))
    assert frozen_counts(decisions) == [0, 2, 3, 3, 3]
    assert decisions[1] is not None and decisions[1].details["bound"] == 2
    assert decisions[1].details["spent"] == pytest.approx(0.4)
    assert policy.cap_binds == 1  # three converged in window 2, the budget allowed two


def test_gradient_freezes_nothing_while_the_bottom_layer_still_changes() -> None:
    trace = [[0.5**window] + [1.0] * (NUM_LAYERS - 1) for window in range(6)]
    assert frozen_counts(run(build("gradient", alpha=1.0), trace)) == [0] * 6


def test_gradient_max_change_keeps_layers_that_all_still_move() -> None:
    # Every layer's norm shrinks 20-30% per window: the percentile alone still finds a "converged" half
    # (the bottom three, changing least), max_change 0.1 finds none until they settle to 5% per window.
    moving = [[0.8**window] * 3 + [0.7**window] * 3 for window in range(4)]
    settled = [[0.8**3 * 0.95**window] * 3 + [0.7 ** (3 + window)] * 3 for window in range(1, 4)]
    trace = moving + settled
    assert frozen_counts(run(build("gradient", alpha=1.0), trace)) == [0, 3, 3, 3, 3, 3, 3]
    counts = frozen_counts(run(build("gradient", alpha=1.0, max_change=0.1), trace))
    assert counts == [0, 0, 0, 0, 3, 3, 3]
    decision = run(build("gradient", alpha=1.0, max_change=0.1), trace)[4]
    assert decision is not None and decision.details["threshold"] == pytest.approx(0.1)


def test_max_change_must_be_positive() -> None:
    with pytest.raises(ValueError, match="freeze.max_change must be > 0"):
        build("gradient", max_change=0.0)


def test_gradient_compares_window_means_over_epoch_windows() -> None:
    # Epochs of 2 and then 4 steps; layer 0's per-step norm is constant, so its mean does not change.
    policy = build("gradient", alpha=1.0, interval_unit="epochs")
    norms = [1.0] + [3.0] * (NUM_LAYERS - 1)
    for step in range(2):
        policy.observe(norms)
        assert policy.decide(step, 0, step == 1) is None
    later = [1.0] + [1.0] * (NUM_LAYERS - 1)
    decision = None
    for step in range(2, 6):
        policy.observe(later)
        decision = policy.decide(step, 1, step == 5)
    assert decision is not None and decision.frozen == frozenset({0})


def recorded_style_trace(steps: int, seed: int) -> list[list[float]]:
    """Norms decaying to a plateau, faster in lower layers, with multiplicative noise (as in fine-tuning logs)."""
    rng = np.random.default_rng(seed)
    time_constants = np.linspace(2.0, 30.0, NUM_LAYERS)
    rows = []
    for step in range(steps):
        clean = 1.0 + 4.0 * np.exp(-step / time_constants)
        rows.append((clean * rng.lognormal(0.0, 0.02, NUM_LAYERS)).tolist())
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gradient_on_recorded_style_traces_freezes_lower_layers_first_within_bounds(seed: int) -> None:
    policy = build("gradient", interval=5, alpha=0.3, max_fraction=0.84)
    decisions = run(policy, recorded_style_trace(120, seed))
    made = [d for d in decisions if d is not None]
    for decision in made:
        assert decision.frozen == frozenset(range(len(decision.frozen)))  # always a prefix
        assert len(decision.frozen) <= min(decision.details["bound"], 5)
    # At first layer 0 changes fastest of all, so it holds everything back; it freezes first once it
    # settles, and the others follow in the order they converge, up to the cap.
    assert made[0].details["decision_index"] > 1 and made[0].frozen == frozenset({0})
    assert [len(d.frozen) for d in made] == sorted({len(d.frozen) for d in made})
    assert policy.frozen == frozenset(range(5))


def test_schedule_freezes_at_the_given_steps_and_epochs() -> None:
    decisions = run(build("schedule", schedule=[[2, 1], [5, 3]], max_fraction=1.0), [[1.0] * NUM_LAYERS] * 8)
    assert frozen_counts(decisions) == [0, 1, 1, 1, 3, 3, 3, 3]
    by_epoch_policy = build("schedule", interval_unit="epochs", schedule=[[1, 2]])
    by_epoch = run(by_epoch_policy, [[1.0] * NUM_LAYERS] * 6, steps_per_epoch=3)
    assert frozen_counts(by_epoch) == [0, 0, 2, 2, 2, 2]


@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize("unit", ["steps", "epochs"])
def test_an_extra_call_reporting_the_epoch_end_counts_no_extra_step(name: str, unit: str) -> None:
    # One trainer calls decide once per step; another calls it per step with epoch_end=False and once
    # more with the same step and epoch_end=True when the sampler runs dry. Both must decide alike.
    steps_per_epoch = 3
    schedule = [[2, 1], [7, 3]] if name == "schedule" else None
    options = {"interval": 1 if unit == "steps" else 2, "interval_unit": unit, "schedule": schedule, "alpha": 0.2}
    trace = recorded_style_trace(30, seed=1)
    once, twice = build(name, **options), build(name, **options)
    expected = run(once, trace, steps_per_epoch=steps_per_epoch)
    got: list[FreezeDecision | None] = []
    for step, norms in enumerate(trace, start=1):
        twice.observe(norms, converging_dots(norms, step - 1), converging_descents(step - 1))
        epoch = (step - 1) // steps_per_epoch
        decision = twice.decide(step, epoch, False)
        if step % steps_per_epoch == 0:
            decision = twice.decide(step, epoch, True) or decision
        got.append(decision)
    assert [d and d.frozen for d in got] == [d and d.frozen for d in expected]
    assert twice.state_dict()["windows_done"] == once.state_dict()["windows_done"]


def test_none_never_freezes() -> None:
    assert frozen_counts(run(policy := build("none"), stable_bottom_trace(10, NUM_LAYERS))) == [0] * 10
    assert policy.outcome() == "nothing froze: freeze.policy is none"  # no windows to count: it decides nothing
    assert build("none", prior_layers=2).outcome() == "nothing froze beyond the prior's 2 layers: freeze.policy is none"


def random_decisions(seed: int, windows: int = 6) -> list[frozenset[int]]:
    decisions = run(build("random", seed=seed, num_layers=8), [[1.0] * 8] * windows)
    return [d.frozen for d in decisions if d is not None]


def test_random_is_seeded_reproducible_counts_like_geometric_and_not_always_a_prefix() -> None:
    assert random_decisions(3) == random_decisions(3)
    runs = [random_decisions(seed) for seed in range(10)]
    assert len({tuple(map(tuple, map(sorted, r))) for r in runs}) > 1
    geometric = [d.frozen for d in run(build("geometric", num_layers=8), [[1.0] * 8] * 6) if d is not None]
    for frozen_sets in runs:
        assert [len(f) for f in frozen_sets] == [len(f) for f in geometric]
        assert all(a < b for a, b in zip(frozen_sets, frozen_sets[1:]))
    assert any(f != frozenset(range(len(f))) for r in runs for f in r)


norm_rows = st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=NUM_LAYERS, max_size=NUM_LAYERS)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(POLICY_NAMES),
    trace=st.lists(norm_rows, min_size=1, max_size=30),
    interval=st.integers(1, 4),
    alpha=st.floats(0.05, 1.0),
    percentile=st.floats(0.0, 100.0),
    max_fraction=st.floats(0.0, 1.0),
)
def test_every_policy_is_monotone_and_capped(
    name: str, trace: list[list[float]], interval: int, alpha: float, percentile: float, max_fraction: float
) -> None:
    schedule = [[1, 1], [4, 3], [9, 6]] if name == "schedule" else None
    policy = build(
        name, interval=interval, alpha=alpha, percentile=percentile, max_fraction=max_fraction, schedule=schedule
    )
    previous: frozenset[int] = frozenset()
    for step, norms in enumerate(trace):
        policy.observe(norms, converging_dots(norms, step), converging_descents(step))
        decision = policy.decide(step, 0, False)
        assert policy.frozen >= previous
        if decision is not None:
            assert decision.frozen > previous and decision.frozen == policy.frozen
            json.dumps(decision.details)
        if name in DECIDING_POLICIES:
            assert len(policy.frozen) <= math.floor(max_fraction * NUM_LAYERS + 1e-9)
        previous = policy.frozen


@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize("cut", [3, 9, 28])  # mid-window, at a window end, mid-window between freezes
def test_state_dict_round_trip_gives_identical_future_decisions(name: str, cut: int) -> None:
    schedule = [[4, 1], [12, 4]] if name == "schedule" else None
    options = {"interval": 2, "alpha": 0.2, "max_fraction": 0.84, "schedule": schedule}
    trace = recorded_style_trace(60, seed=5)
    original = build(name, **options)
    run(original, trace[:cut])
    resumed = build(name, **options)
    resumed.load_state_dict(json.loads(json.dumps(original.state_dict())))
    assert resumed.frozen == original.frozen
    after = run(original, trace[cut:], start=cut)
    assert run(resumed, trace[cut:], start=cut) == after
    if name == "gradient" or (name != "none" and cut < 11):
        assert any(after), "the resumed part should contain decisions to compare"


def test_load_state_dict_rejects_another_policy() -> None:
    with pytest.raises(ValueError, match="freeze.policy"):
        build("geometric").load_state_dict(build("gradient").state_dict())


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"alpha": 0.0}, "freeze.alpha"),
        ({"alpha": 1.5}, "freeze.alpha"),
        ({"percentile": -1.0}, "freeze.percentile"),
        ({"percentile": 100.5}, "freeze.percentile"),
        ({"max_fraction": 1.2}, "freeze.max_fraction"),
        ({"evidence_max_fraction": 0.0}, "freeze.evidence_max_fraction"),
        ({"interval": 0}, "freeze.interval"),
        ({"interval_unit": "minutes"}, "freeze.interval_unit"),
    ],
)
def test_bad_arguments_say_what_to_set(overrides: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as error:
        build("gradient", **overrides)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("name", "schedule"),
    [
        ("autofreeze", None),
        ("schedule", None),
        ("schedule", [[3, 2], [2, 4]]),
        ("schedule", [[1, 3], [2, 1]]),
        ("schedule", [[1, 9]]),
    ],
)
def test_bad_names_and_schedules_are_rejected(name: str, schedule: list[list[int]] | None) -> None:
    with pytest.raises(ValueError, match="freeze") as error:
        build(name, schedule=schedule)
    assert "\n" not in str(error.value)


def test_observe_needs_one_norm_per_layer_and_gradient_needs_observations() -> None:
    with pytest.raises(ValueError, match="one gradient norm per layer"):
        build("gradient").observe([1.0] * (NUM_LAYERS - 1))
    with pytest.raises(RuntimeError, match="observe"):
        build("gradient").decide(0, 0, False)


def test_frozen_prefix_and_blocks() -> None:
    assert frozen_prefix_layers([]) == 0
    assert frozen_prefix_layers({0, 1, 3}) == 2
    assert frozen_blocks({0, 1}, 4) == frozenset({0, 1, 2})
    assert frozen_blocks({2}, 4) == frozenset({3})  # embeddings freeze only with layer 0
    with pytest.raises(ValueError, match="layer indices"):
        frozen_blocks({4}, 4)


# --- coherence: freeze the layers whose gradient turned into noise --------------------------------


def coherence_trace(coherence_rows: Sequence[Sequence[float | None]], norm: float = 2.0
                    ) -> tuple[list[list[float]], list[list[float | None]]]:
    """Norms and dot products giving each layer the given per-step coherence (None: no valid dot product)."""
    norms = [[norm] * len(row) for row in coherence_rows]
    dots = [[None if c is None else c * norm * norm for c in row] for row in coherence_rows]
    return norms, dots


LEARNING = [0.5] * NUM_LAYERS
"""A window in which every layer learns: coherence well above any threshold used here."""


def test_coherence_freezes_the_prefix_below_the_threshold_and_a_learning_layer_holds_the_rest() -> None:
    # layer 2 still learns (0.3), so layers 3 and 4 below the threshold stay active too
    norms, dots = coherence_trace([LEARNING] + [[0.01, 0.05, 0.3, 0.02, 0.01, 0.5]] * 3)
    decisions = run(build("coherence", alpha=1.0, threshold=0.1), norms, dots=dots)
    assert decisions[:2] == [None, None]  # learning, then one window below: converged needs two in a row
    assert decisions[2] is not None and decisions[2].frozen == frozenset({0, 1})
    details = decisions[2].details
    assert details["candidate"] == 2 and details["coherence"] == pytest.approx([0.01, 0.05, 0.3, 0.02, 0.01, 0.5])
    json.dumps(details)
    assert decisions[3] is None


def test_coherence_needs_two_windows_in_a_row_below_the_threshold() -> None:
    # layer 0 dips below the threshold in windows 2 and 4 only (noise); layer 1 from window 3 on
    norms, dots = coherence_trace([LEARNING, [0.05, 0.5, 0.5, 0.5, 0.5, 0.5], [0.3, 0.05, 0.5, 0.5, 0.5, 0.5],
                                   [0.05, 0.05, 0.5, 0.5, 0.5, 0.5], [0.05, 0.05, 0.5, 0.5, 0.5, 0.5]])
    counts = frozen_counts(run(build("coherence", alpha=1.0, threshold=0.1), norms, dots=dots))
    assert counts == [0, 0, 0, 0, 2]


def test_coherence_learned_by_layer_waits_for_the_layer_itself_to_learn() -> None:
    # Layer 0 is noise from the start (it has not started learning), then learns, then settles.
    norms, dots = coherence_trace([[0.01] + [0.5] * 5] * 3 + [LEARNING] + [[0.01] + [0.5] * 5] * 2)
    counts = frozen_counts(run(build("coherence", alpha=1.0, threshold=0.1, learned_by="layer"), norms, dots=dots))
    assert counts == [0, 0, 0, 0, 0, 1]
    # the default starts its test with the first window in which any layer learned (layers 1-5 in window 1)
    counts = frozen_counts(run(build("coherence", alpha=1.0, threshold=0.1), norms, dots=dots))
    assert counts == [0, 0, 1, 1, 1, 1]


def test_coherence_is_a_window_ratio_of_sums_not_a_mean_of_ratios() -> None:
    # Layer 0: two steps with coherence 0.0 and 0.3 but the second step's gradient is twice as large:
    # (0 + 0.3 * 16) / (4 + 16) = 0.24 >= 0.2 (learning), though the mean of the two ratios (0.15) is below it.
    policy = build("coherence", interval=2, alpha=1.0, threshold=0.2)
    policy.observe([2.0] + [1.0] * 5, [0.0] + [0.0] * 5)
    assert policy.decide(1, 0, False) is None
    policy.observe([4.0] + [1.0] * 5, [0.3 * 16] + [0.0] * 5)
    assert policy.decide(2, 0, False) is None
    assert policy.previous_coherence[0] == pytest.approx(0.24) and policy.learned[0]
    assert not any(policy.learned[1:])


def test_coherence_counts_a_layer_without_valid_dot_products_as_learning() -> None:
    norms, dots = coherence_trace([LEARNING] + [[None, 0.01, 0.01, 0.01, 0.01, 0.01]] * 2)
    assert run(build("coherence", alpha=1.0), norms, dots=dots) == [None, None, None]
    with pytest.raises(ValueError, match="layer_grad_dots"):
        build("coherence").observe([1.0] * NUM_LAYERS)


def test_coherence_is_bounded_by_the_learning_rate_budget_and_records_why() -> None:
    norms, dots = coherence_trace([LEARNING] + [[0.01] * NUM_LAYERS] * 5)
    policy = build("coherence", max_fraction=0.84, spent=[k / NUM_LAYERS for k in range(1, NUM_LAYERS + 1)])
    decisions = run(policy, norms, dots=dots)
    # budget floor(6 * k / 6) = k after window k; from the third window every layer has converged (6), which
    # max_fraction turns into 5: the budget holds it back in windows 3 and 4
    assert frozen_counts(decisions) == [0, 0, 3, 4, 5, 5]
    assert [d.details["candidate"] for d in decisions if d] == [6] * 3
    assert [d.details["bound"] for d in decisions if d] == [3, 4, 5]
    assert policy.cap_binds == 2
    third = decisions[2]
    assert third is not None
    assert third.details["reasons"] == ["freezes"] * 3 + ["held:budget"] * 3
    fifth = decisions[4]
    assert fifth is not None and fifth.details["reasons"] == ["frozen"] * 4 + ["freezes", "held:budget"]


def test_the_evidence_cap_keeps_the_top_layers_training_and_binds_no_other_policy() -> None:
    norms, dots = coherence_trace([LEARNING] + [[0.01] * NUM_LAYERS] * 5)
    spent = [k / NUM_LAYERS for k in range(1, NUM_LAYERS + 1)]
    policy = build("coherence", evidence_max_fraction=0.5, spent=spent)
    decisions = run(policy, norms, dots=dots)
    # budget k after window k, capped at floor(0.5 * 6) = 3: the top half keeps training
    assert frozen_counts(decisions) == [0, 0, 3, 3, 3, 3]
    assert policy.cap_binds == 4  # the budget in window 3, then the cap in every window after it
    last = decisions[2]
    assert last is not None and last.details["evidence_cap"] == 3
    assert policy.last_window is not None
    assert policy.last_window["reasons"] == ["frozen"] * 3 + ["held:evidence_max_fraction"] * 3
    prior = build("coherence", evidence_max_fraction=0.5, prior_layers=2, spent=spent)
    assert frozen_counts(run(prior, norms, dots=dots))[-1] == 3  # the prior's layers count toward the cap
    below_prior = build("coherence", evidence_max_fraction=0.2, prior_layers=2, spent=spent)
    run(below_prior, norms, dots=dots)
    assert below_prior.frozen == frozenset({0, 1})  # never fewer than the prior
    assert below_prior.outcome() == ("nothing froze beyond the prior's 2 layers: freeze.evidence_max_fraction allows "
                                     "no layer beyond it")
    uncapped = frozen_counts(run(build("gradient", percentile=90.0), stable_bottom_trace(windows=3, stable=5)))
    capped = frozen_counts(run(build("gradient", percentile=90.0, evidence_max_fraction=1 / 3),
                               stable_bottom_trace(windows=3, stable=5)))
    assert (uncapped[-1], capped[-1]) == (5, 2)
    geometric = build("geometric", evidence_max_fraction=0.5, alpha=0.5)
    assert frozen_counts(run(geometric, [[1.0] * NUM_LAYERS] * 3))[-1] == 5  # a schedule of its own: not capped


def test_a_reason_for_every_layer_in_every_window() -> None:
    """Not learned yet, learning, one window below, above a layer still learning, held by the one-layer pace."""
    layers_2_3_converged = [0.5, 0.5, 0.01, 0.01, 0.5, 0.5]
    norms, dots = coherence_trace([[0.01] * NUM_LAYERS, LEARNING, [0.01] * NUM_LAYERS, [0.01] * NUM_LAYERS,
                                   layers_2_3_converged])
    windows = []
    policy = build("coherence", max_advance=1)
    for step, (n, d) in enumerate(zip(norms, dots), start=1):
        policy.observe(n, d)
        policy.decide(step, 0, epoch_end=False)
        windows.append(policy.last_window["reasons"] if policy.last_window else None)
    assert windows[0] == ["not_learned"] * NUM_LAYERS  # low coherence before any learning: not a convergence
    assert windows[1] == ["learning"] * NUM_LAYERS
    assert windows[2] == ["one_window_below"] * NUM_LAYERS
    assert windows[3] == ["freezes"] + ["held:max_advance"] * (NUM_LAYERS - 1)
    assert windows[4] == ["frozen", "learning", "above_learning", "above_learning", "learning", "learning"]


def test_the_prior_starts_frozen_and_evidence_builds_on_it() -> None:
    norms, dots = coherence_trace([LEARNING] + [[0.01] * NUM_LAYERS] * 4)
    policy = build("coherence", prior_layers=2, max_advance=1, spent=[0.25, 0.5, 0.75, 1.0, 1.0])
    assert policy.frozen == frozenset({0, 1})
    decisions = run(policy, norms, dots=dots)
    # budget 2 + floor(4 * spent): 3, 4, 5, 6, 6 (the prior's two count from the first step)
    assert frozen_counts(decisions) == [0, 0, 3, 4, 5]
    assert policy.outcome() == "5 of 6 layers frozen in 5 decision windows"
    nothing = build("coherence", prior_layers=2)
    assert nothing.outcome() == ("nothing froze beyond the prior's 2 layers in 0 decision windows: the coherence test "
                                 "needs 3 (one to learn, two below the threshold); shorten freeze.interval (or "
                                 "freeze.min_window_steps)")
    with pytest.raises(ValueError, match="prior_layers"):
        build("coherence", prior_layers=NUM_LAYERS)
    state = policy.state_dict()
    with pytest.raises(ValueError, match="freeze.prior"):
        build("coherence").load_state_dict(state)


def test_coherence_max_advance_freezes_converged_layers_a_few_at_a_time() -> None:
    norms, dots = coherence_trace([LEARNING] + [[0.01] * NUM_LAYERS] * 5)
    unlimited = run(build("coherence", alpha=1.0, max_fraction=0.84), norms, dots=dots)
    policy = build("coherence", alpha=1.0, max_fraction=0.84, max_advance=2)
    limited = run(policy, norms, dots=dots)
    assert frozen_counts(unlimited) == [0, 0, 5, 5, 5, 5]  # every layer converged at once
    assert frozen_counts(limited) == [0, 0, 2, 4, 5, 5]
    assert [d.details["advance_limit"] for d in limited if d] == [2, 4, 6]
    assert policy.cap_binds == 0  # the advance limit is the policy's own pace, not the geometric cap
    with pytest.raises(ValueError, match="max_advance"):
        build("coherence", max_advance=0)


NOISE = [0.01] * NUM_LAYERS
"""A window in which every layer's gradient is noise: coherence below any threshold used here."""


PRETRAINED_BOTTOM = [0.01, 0.01, 0.5, 0.5, 0.5, 0.5]
"""A window in which the upper layers learn and the bottom two carry only noise, as a pretrained layer may."""


def test_coherence_learned_by_any_layer_tests_a_layer_that_never_learned_itself() -> None:
    # The bottom two layers never reach the threshold; the upper four learn, then every layer turns to noise.
    norms, dots = coherence_trace([PRETRAINED_BOTTOM] * 2 + [NOISE] * 3)
    own = build("coherence", alpha=1.0, threshold=0.1, learned_by="layer")
    assert set(frozen_counts(run(own, norms, dots=dots))) == {0}
    assert "freeze.learned_by: any_layer" in own.outcome()
    anyone = build("coherence", alpha=1.0, threshold=0.1)  # the default
    # once layers 2-5 learned (window 1), layers 0-1 below the threshold in windows 2-3 count as converged;
    # the upper layers, noise from window 3, follow after their own two windows (window 4)
    assert frozen_counts(run(anyone, norms, dots=dots)) == [0, 0, 2, 6, 6]
    with pytest.raises(ValueError, match="learned_by"):
        build("coherence", learned_by="model")


@pytest.mark.parametrize("cut", [1, 2, 3])
def test_coherence_learned_by_any_layer_resumes_with_the_same_decisions(cut: int) -> None:
    norms, dots = coherence_trace([PRETRAINED_BOTTOM] * 2 + [NOISE] * 3)
    original = build("coherence", alpha=1.0, threshold=0.1, learned_by="any_layer")
    run(original, norms[:cut], dots=dots[:cut])
    resumed = build("coherence", alpha=1.0, threshold=0.1, learned_by="any_layer")
    resumed.load_state_dict(json.loads(json.dumps(original.state_dict())))
    after = run(original, norms[cut:], start=cut, dots=dots[cut:])
    assert run(resumed, norms[cut:], start=cut, dots=dots[cut:]) == after and any(after)


def test_coherence_learned_by_any_layer_still_waits_for_some_layer_to_learn() -> None:
    norms, dots = coherence_trace([NOISE] * 5)
    policy = build("coherence", alpha=1.0, threshold=0.1, learned_by="any_layer")
    assert set(frozen_counts(run(policy, norms, dots=dots))) == {0}
    assert "no layer's gradient coherence ever reached 0.1" in policy.outcome()


def test_coherence_learned_min_steps_needs_learning_that_lasts_that_many_steps() -> None:
    # one 1-step window of learning among noise: enough for the default, not for learned_min_steps 2
    norms, dots = coherence_trace([LEARNING] + [NOISE] * 4)
    assert frozen_counts(run(build("coherence", alpha=1.0, threshold=0.1), norms, dots=dots)) == [0, 0, 6, 6, 6]
    brief = build("coherence", alpha=1.0, threshold=0.1, learned_min_steps=2)
    assert set(frozen_counts(run(brief, norms, dots=dots))) == {0}
    assert "no layer's gradient coherence ever reached 0.1 over 2 steps in a row" in brief.outcome()
    # two consecutive windows of learning: the test starts after the second
    norms, dots = coherence_trace([LEARNING] * 2 + [NOISE] * 3)
    lasting = build("coherence", alpha=1.0, threshold=0.1, learned_min_steps=2)
    assert frozen_counts(run(lasting, norms, dots=dots)) == [0, 0, 0, 6, 6]
    # two windows above with one below between them do not add up
    norms, dots = coherence_trace([LEARNING, NOISE, LEARNING] + [NOISE] * 3)
    assert set(frozen_counts(run(build("coherence", alpha=1.0, threshold=0.1, learned_min_steps=2),
                                 norms, dots=dots))) == {0}
    # a window as long as learned_min_steps counts alone: 2-step windows, learning in the first
    norms, dots = coherence_trace([LEARNING] * 2 + [NOISE] * 4)
    long_windows = build("coherence", interval=2, alpha=1.0, threshold=0.1, learned_min_steps=2)
    assert frozen_counts(run(long_windows, norms, dots=dots)) == [0, 0, 0, 0, 0, 6]
    with pytest.raises(ValueError, match="learned_min_steps"):
        build("coherence", learned_min_steps=0)


@pytest.mark.parametrize("cut", [1, 2, 3, 4])
def test_coherence_learned_min_steps_resumes_with_the_same_decisions(cut: int) -> None:
    norms, dots = coherence_trace([NOISE, LEARNING, LEARNING] + [NOISE] * 3)
    original = build("coherence", alpha=1.0, threshold=0.1, learned_min_steps=2)
    run(original, norms[:cut], dots=dots[:cut])
    resumed = build("coherence", alpha=1.0, threshold=0.1, learned_min_steps=2)
    resumed.load_state_dict(json.loads(json.dumps(original.state_dict())))
    after = run(original, norms[cut:], start=cut, dots=dots[cut:])
    assert run(resumed, norms[cut:], start=cut, dots=dots[cut:]) == after and any(after)


@pytest.mark.parametrize(("learned_min_steps", "interval", "needed"),
                         [(1, 10, 3), (20, 10, 4), (20, 20, 3), (25, 10, 5)])
def test_coherence_windows_before_a_freeze_count_the_windows_of_learning(
        learned_min_steps: int, interval: int, needed: int) -> None:
    policy = build("coherence", interval=interval, learned_min_steps=learned_min_steps)
    assert policy.windows_before_a_freeze(interval) == needed
    assert build("gradient").windows_before_a_freeze(interval) == 2
    assert build("geometric").windows_before_a_freeze(interval) == 1


def test_every_window_end_leaves_its_numbers_frozen_or_not() -> None:
    norms, dots = coherence_trace([LEARNING] + [NOISE] * 3)
    policy = build("coherence", interval=1, alpha=1.0, threshold=0.1, max_fraction=0.5)
    windows = []
    for step, (row, row_dots) in enumerate(zip(norms, dots)):
        policy.observe(row, row_dots)
        policy.decide(step, 0, False)
        windows.append(policy.last_window)
    assert [w["window"] for w in windows] == [1, 2, 3, 4]
    assert [w["frozen"] for w in windows] == [[], [], [0, 1, 2], [0, 1, 2]]  # the last changes nothing
    assert windows[1]["coherence"] == pytest.approx([0.01] * NUM_LAYERS) and windows[1]["candidate"] == 0
    json.dumps(windows)
    between = build("coherence", interval=2, alpha=1.0)
    between.observe(norms[0], dots[0])
    between.decide(0, 0, False)
    assert between.last_window is None  # no window ended at this step
    schedule = build("schedule", schedule=[[1, 1]], max_fraction=1.0)
    run(schedule, [[1.0] * NUM_LAYERS] * 3)
    assert schedule.last_window is None  # a schedule has no windows to report


@pytest.mark.parametrize(("windows", "learned_by", "needle"), [
    ([NOISE] * 6, "layer", "layer 0's gradient coherence never reached 0.1"),  # noise from the start: never learned
    ([PRETRAINED_BOTTOM] * 6, "layer", "layer 0's gradient coherence never reached 0.1"),
    ([NOISE] * 6, "any_layer", "no layer's gradient coherence ever reached 0.1"),
    ([LEARNING] * 6, "layer", "layer 0 learned, but its gradient coherence never stayed below 0.1"),
    ([LEARNING] * 6, "any_layer", "a layer learned, but layer 0's gradient coherence never stayed below 0.1"),
    ([LEARNING, NOISE] + [LEARNING, NOISE] * 2, "layer", "layer 0 learned, but"),  # below for one window at a time
    ([LEARNING, NOISE], "any_layer", "needs 3 (one to learn, two below the threshold); shorten freeze.interval"),
])
def test_coherence_outcome_says_why_nothing_froze(windows: list[list[float]], learned_by: str, needle: str) -> None:
    norms, dots = coherence_trace(windows)
    policy = build("coherence", alpha=1.0, threshold=0.1, learned_by=learned_by)
    assert set(frozen_counts(run(policy, norms, dots=dots))) == {0}
    assert policy.outcome().startswith(f"nothing froze in {len(windows)} decision windows: ")
    assert needle in policy.outcome()


@pytest.mark.parametrize(("learned_by", "needle"), [
    ("layer", "layer 2 learned, but its gradient coherence never stayed below 0.1"),
    ("any_layer", "a layer learned, but layer 2's gradient coherence never stayed below 0.1"),
])
def test_coherence_outcome_names_the_first_layer_above_the_prior(learned_by: str, needle: str) -> None:
    norms, dots = coherence_trace([LEARNING] * 6)  # layers 0-1 are the prior's: the evidence starts at layer 2
    policy = build("coherence", alpha=1.0, threshold=0.1, learned_by=learned_by, prior_layers=2)
    run(policy, norms, dots=dots)
    assert len(policy.frozen) == 2
    assert policy.outcome().startswith("nothing froze beyond the prior's 2 layers") and needle in policy.outcome()


def test_outcome_counts_what_froze_or_names_the_bound_that_forbids_it() -> None:
    norms, dots = coherence_trace([LEARNING] + [NOISE] * 2)
    policy = build("coherence", alpha=1.0, threshold=0.1, max_fraction=0.5)
    run(policy, norms, dots=dots)
    assert policy.outcome() == f"3 of {NUM_LAYERS} layers frozen in 3 decision windows"
    forbidden = build("coherence", alpha=1.0, threshold=0.1, max_fraction=0.0)
    run(forbidden, norms, dots=dots)
    assert forbidden.outcome() == "nothing froze: freeze.max_fraction allows no layer"
    geometric = build("geometric", interval=10)
    run(geometric, [[1.0] * NUM_LAYERS] * 3)
    assert geometric.outcome() == "nothing froze in 0 decision windows"


def test_schedule_outcome_names_the_schedule_not_windows() -> None:
    frozen = build("schedule", schedule=[[2, 1], [5, 3]], max_fraction=1.0)
    run(frozen, [[1.0] * NUM_LAYERS] * 8)
    assert frozen.outcome() == f"3 of {NUM_LAYERS} layers frozen by freeze.schedule"
    late = build("schedule", schedule=[[0, 0], [20, 2]], max_fraction=1.0)
    run(late, [[1.0] * NUM_LAYERS] * 8)
    assert late.outcome() == "nothing froze: freeze.schedule's first freeze is due after 20 steps, the run did 8"


def test_a_schedule_entry_at_zero_holds_before_the_first_step() -> None:
    """``[[0, k]]`` is "frozen from the start", as the prior is: no step may train those layers first."""
    start = build("schedule", schedule=[[0, 2], [3, 4]], max_fraction=1.0)
    assert start.frozen == frozenset({0, 1})
    assert start.start_decision is not None and start.start_decision.step == 0
    assert start.start_decision.details == {"at": 0, "scheduled": 2}
    decisions = run(start, [[1.0] * NUM_LAYERS] * 4)
    assert [d.step if d else None for d in decisions] == [None, None, 2, None]  # the entry at 3: after 3 steps
    assert start.frozen == frozenset(range(4))
    within_prior = build("schedule", schedule=[[0, 1]], max_fraction=1.0, prior_layers=2)
    assert within_prior.frozen == frozenset({0, 1}) and within_prior.start_decision is None
    assert build("schedule", schedule=[[5, 1]], max_fraction=1.0).start_decision is None


def test_coherence_of_simulated_gradients_tells_signal_from_noise() -> None:
    """Real vectors, 10k dimensions: every layer's gradient keeps its direction for a window; then layers 0-2
    turn into independent noise around zero while layers 3-5 keep a signal as large as their noise."""
    rng = np.random.default_rng(0)
    direction = rng.standard_normal(10_000)
    policy = build("coherence", interval=20, alpha=1.0, threshold=0.1)
    previous: list[np.ndarray] | None = None
    decision = None
    for step in range(60):
        grads = [rng.standard_normal(10_000) + (direction if layer >= 3 or step < 20 else 0.0)
                 for layer in range(NUM_LAYERS)]
        dots = None if previous is None else [float(g @ p) for g, p in zip(grads, previous)]
        policy.observe([float(np.linalg.norm(g)) for g in grads], dots or [None] * NUM_LAYERS)
        decision = policy.decide(step, 0, False) or decision
        previous = grads
    assert decision is not None and decision.frozen == frozenset({0, 1, 2}) and decision.step == 59
    coherence = decision.details["coherence"]
    assert all(abs(c) < 0.02 for c in coherence[:3]) and all(0.4 < c < 0.6 for c in coherence[3:])


@pytest.mark.parametrize(("fraction", "total", "floor", "expected"), [
    (0.05, 96, 20, 20),  # a tiny run: 5% is 5 steps, the floor keeps windows at 20
    (0.05, 20_000, 20, 1_000),  # a large run: 5% of it
    (0.05, 10, 20, 20),  # a window longer than the run: the trainer warns that nothing will freeze
    (1.0, 300, 1, 300),
])
def test_fraction_windows_scale_with_the_run_above_a_floor(fraction: float, total: int, floor: int,
                                                           expected: int) -> None:
    assert window_steps(fraction, total, floor) == expected


def test_policy_from_settings_turns_a_fraction_into_steps() -> None:
    settings = FreezeConfig(enabled=True, policy="geometric", interval=0.1, interval_unit="fraction",
                            min_window_steps=5, alpha=1 / 3, max_fraction=0.5)
    policy = policy_from_settings(settings, NUM_LAYERS, seed=0, total_steps=200)
    assert (policy.interval, policy.interval_unit) == (20, "steps")
    counts = frozen_counts(run(policy, [[1.0] * NUM_LAYERS] * 40))
    assert counts[18:21] == [0, 2, 2] and counts[39] == 3
    assert policy_from_settings(settings, NUM_LAYERS, seed=0, total_steps=30).interval == 5
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        window_steps(1.5, 100, 1)


def test_the_python_api_and_the_cli_build_the_same_default_freezer() -> None:
    """``FreezeConfig`` owns every default: ``make_policy``'s keyword defaults are its fields, and a policy built
    from the Python API with no settings equals the one a default config builds, field by field."""
    import dataclasses
    import inspect

    fields = {f.name: f.default for f in dataclasses.fields(FreezeConfig)}
    for name, parameter in inspect.signature(make_policy).parameters.items():
        if name in fields and parameter.default is not inspect.Parameter.empty:
            assert parameter.default == fields[name], name
    total = 200
    settings = FreezeConfig(enabled=True)
    from_cli = policy_from_settings(settings, NUM_LAYERS, seed=0, total_steps=total)
    from_api = make_policy(settings.policy, NUM_LAYERS, interval=window_steps(settings.interval, total,
                                                                            settings.min_window_steps),
                           interval_unit="steps", seed=0, spent=[(step + 1) / total for step in range(total)])
    assert type(from_api) is type(from_cli)
    for attribute in ("interval", "interval_unit", "max_frozen", "evidence_cap", "prior_layers", "threshold",
                      "max_advance", "jitter_max_share", "early_cap"):
        assert getattr(from_api, attribute) == getattr(from_cli, attribute), attribute
    assert from_api.spent == pytest.approx(from_cli.spent)


def descent_windows(means: Sequence[Sequence[float | None]], steps: int = 4, spread: float = 1.0,
                    policy: FreezePolicy | None = None, **overrides: Any) -> tuple[FreezePolicy,
                                                                                 list[FreezeDecision | None]]:
    """Feed one window of ``steps`` steps per row of per-layer mean descents (each step the mean +- ``spread``,
    alternating, so a window's t-statistic is ``mean / (spread * sqrt(steps / (steps - 1)) / sqrt(steps))``);
    ``None``: no valid descent for that layer. Returns the policy and the decision after each window."""
    policy = policy or build("descent", interval=steps, **{"max_advance": None, **overrides})
    decisions = []
    step = policy.steps_done
    for row in means:
        for offset in range(steps):
            sign = 1.0 if offset % 2 == 0 else -1.0
            policy.observe([1.0] * len(row), None, [None if m is None else m + sign * spread for m in row])
            decision = policy.decide(step, 0, False)
            step += 1
        decisions.append(decision)
    return policy, decisions


LEARNING = [3.0] * NUM_LAYERS  # every layer's updates lower new batches' loss: t = 5.2 over 4 steps


def test_descent_freezes_the_prefix_whose_updates_stopped_lowering_new_batches_loss() -> None:
    stopped = [-1.0, -1.0, 2.0, -1.0, -1.0, -1.0]  # layer 2 still descends: it holds everything above it
    policy, decisions = descent_windows([LEARNING, stopped, stopped])
    assert decisions[:2] == [None, None] and decisions[2] is not None
    assert decisions[2].frozen == frozenset({0, 1})
    assert policy.last_window is not None
    assert policy.last_window["reasons"] == ["freezes", "freezes", "descending", "above_learning", "above_learning",
                                             "above_learning"]
    t = policy.last_window["descent_t"]
    assert t[0] == pytest.approx(-1.0 / (1.0 * math.sqrt(4 / 3) / 2)) and t[2] > 0


def test_descent_needs_the_model_to_have_learned_and_two_windows_below() -> None:
    below = [-1.0] * NUM_LAYERS
    policy, decisions = descent_windows([below, below, below])  # the first steps look like noise too
    assert not any(decisions) and not policy.learned
    assert policy.last_window is not None and set(policy.last_window["reasons"]) == {"not_learned"}
    assert "no layer's descent t ever reached 2.0" in policy.outcome()
    policy, decisions = descent_windows([LEARNING, below, LEARNING, below])
    assert not any(decisions), "one window below, then descending again: not stopped"
    assert policy.last_window is not None and set(policy.last_window["reasons"]) == {"one_window_below"}
    assert "kept lowering the loss on new batches" in policy.outcome()


def test_descent_counts_a_layer_without_valid_descents_as_learning() -> None:
    gap: list[float | None] = [None] + [-1.0] * (NUM_LAYERS - 1)
    _, decisions = descent_windows([LEARNING, gap, gap])
    assert not any(decisions), "layer 0 gave no evidence: nothing above it can freeze"


def test_descent_evidence_grows_with_the_window() -> None:
    """A small steady rise of the loss in noise ten times larger: a short window cannot tell it from noise (t = -0.2,
    above the default threshold of -0.5), a long one can (t = -2); the same holds for a small steady descent, which
    a long window finds learning where a coherence-like ratio of means would call it noise."""
    small = [-0.1] * NUM_LAYERS
    short, decisions = descent_windows([LEARNING, small, small], steps=4,
                                       descent_threshold=FreezeConfig.descent_threshold)
    assert not any(decisions)
    long, decisions = descent_windows([LEARNING, small, small], steps=400,
                                      descent_threshold=FreezeConfig.descent_threshold)
    assert decisions[2] is not None and decisions[2].frozen == frozenset(range(NUM_LAYERS))
    assert long.previous_t[0] == pytest.approx(-0.1 / (math.sqrt(400 / 399) / 20), rel=1e-6)


def test_descent_keeps_to_the_evidence_cap_and_one_layer_a_window_by_default() -> None:
    stopped = [-1.0] * NUM_LAYERS
    policy, decisions = descent_windows([LEARNING, stopped, stopped, stopped, stopped, stopped],
                                        max_advance=1, evidence_max_fraction=0.5)
    assert [len(d.frozen) if d else 0 for d in decisions] == [0, 0, 1, 2, 3, 0]
    assert policy.last_window is not None and policy.last_window["reasons"][3] == "held:evidence_max_fraction"
    assert policy.outcome() == "3 of 6 layers frozen in 6 decision windows"


def test_descent_freezes_the_early_share_at_once_and_deeper_layers_within_the_learning_rate_budget() -> None:
    """``early_max_fraction`` 1/3 of six layers: two freeze as soon as the test allows; the third, which the test found
    stopped too, waits until half the run's learning rate is spent (``budget_layers``: 3 of 6 at 0.5), and the
    half-depth cap still holds the fourth. Without the setting all three freeze at once."""
    stopped = [-1.0] * NUM_LAYERS
    windows = [LEARNING, *[stopped] * 9]
    flat = [(step + 1) / (4 * len(windows)) for step in range(4 * len(windows))]  # spent = share of the steps done
    policy, decisions = descent_windows(windows, evidence_max_fraction=0.5, early_max_fraction=1 / 3, spent=flat)
    # windows of 4 steps of 40: the third ends at 0.3 of the learning rate spent, the fifth at 0.5
    assert [len(d.frozen) if d else None for d in decisions] == [None, None, 2, None, 3, None, None, None, None, None]
    assert policy.last_window is not None and policy.last_window["reasons"][3] == "held:evidence_max_fraction"
    _, decisions = descent_windows(windows[:3], evidence_max_fraction=0.5, spent=flat)
    assert decisions[2] is not None and len(decisions[2].frozen) == 3


def test_descent_records_a_layer_the_learning_rate_budget_holds() -> None:
    stopped = [-1.0] * NUM_LAYERS
    policy, _ = descent_windows([LEARNING, stopped, stopped, stopped], evidence_max_fraction=0.5,
                                early_max_fraction=1 / 3, spent=[(step + 1) / 40 for step in range(40)])
    assert policy.last_window is not None
    assert policy.last_window["reasons"][:4] == ["frozen", "frozen", "held:budget", "held:evidence_max_fraction"]
    assert policy.last_window["early_cap"] == 2


def test_early_max_fraction_is_checked() -> None:
    with pytest.raises(ValueError, match="early_max_fraction must be in"):
        build("descent", early_max_fraction=1.5)


def test_descent_stops_where_the_frozen_prefix_would_hold_more_than_its_share_of_the_jitter() -> None:
    """Every layer stopped; each layer's jitter is its mean loss rise per step (-mean descent). With the jitter spread
    evenly over six layers, half of it is three layers; piled on the top layers (as on the 12-layer ViT), the bottom
    half holds little of it and freezes whole; piled on the bottom layer, even it holds more than half."""
    def depth(jitter: list[float], share: float = 0.5) -> int:
        stopped = [-value for value in jitter]
        policy, decisions = descent_windows([LEARNING, stopped, stopped], spread=0.01, evidence_max_fraction=None,
                                            jitter_max_share=share)
        assert policy.last_window is not None and policy.last_window["jitter"] == pytest.approx(jitter)
        return len(decisions[2].frozen) if decisions[2] else 0

    assert depth([1.0] * 6) == 3
    assert depth([1.0] * 6, share=0.4) == 2
    assert depth([0.2, 0.2, 0.2, 2.0, 2.0, 2.0]) == 4  # the fifth layer would bring the prefix to 4.6 of 6.6
    assert depth([6.0, 1.0, 1.0, 1.0, 1.0, 1.0]) == 0
    stopped = [-6.0, -1.0, -1.0, -1.0, -1.0, -1.0]
    policy, _ = descent_windows([LEARNING, stopped, stopped], spread=0.01, jitter_max_share=0.5)
    assert policy.outcome().endswith("layer 0 stopped learning but held more than 0.5 of the model's jitter "
                                     "(freeze.jitter_max_share)")


def test_the_jitter_profile_is_the_last_one_before_the_first_freeze() -> None:
    """Layers 0-1 freeze with jitter 1 each of 6 (share 0.4 of it: two layers). Afterwards the active layers' jitter
    falls tenfold; measured then, the pair would hold 2 of 2.4 and nothing more freeze; were it to rise instead, more
    would. Either way the depth stays what the profile before the first freeze allowed."""
    early = [-1.0] * NUM_LAYERS
    for later in (-0.1, -10.0):
        after: list[float | None] = [None, None] + [later] * (NUM_LAYERS - 2)  # frozen layers measure nothing
        policy, decisions = descent_windows([LEARNING, early, early, after, after], spread=0.01,
                                            evidence_max_fraction=None, jitter_max_share=0.4)
        assert decisions[2] is not None and decisions[2].frozen == frozenset({0, 1})
        assert decisions[3] is None and decisions[4] is None
        assert policy.jitter == pytest.approx([1.0] * NUM_LAYERS)
        assert policy.last_window is not None and policy.last_window["reasons"][2] == "held:jitter_max_share"
    restored = build("descent", interval=4, max_advance=None, evidence_max_fraction=None, jitter_max_share=0.4)
    restored.load_state_dict(policy.state_dict())
    assert restored.jitter == policy.jitter
