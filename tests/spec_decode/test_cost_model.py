"""The cost model: a step-cost line fitted online, and draft lengths that maximise expected tokens per second."""

from __future__ import annotations

import pytest

from tokenloop.spec_decode.cost_model import StepCosts, choose_draft_lengths


def fitted(a: float, b: float, tokens=(1, 2, 5, 9, 1, 3)) -> StepCosts:
    costs = StepCosts()
    for t in tokens:
        costs.observe(t, a + b * t)
    return costs


def test_the_fit_recovers_the_line():
    assert fitted(0.010, 0.001).line() == pytest.approx((0.010, 0.001), rel=1e-6)


def test_a_cheap_query_token_and_a_good_acceptance_rate_draft_long():
    ks = choose_draft_lengths([0.9], [8], base_tokens=1, base_yield=1, target=fitted(0.010, 0.0002))
    assert ks == [8]


def test_drafting_stops_where_it_does_not_pay():
    # A low acceptance rate: each draft token costs more time than the tokens it is expected to add.
    assert choose_draft_lengths([0.05], [8], 1, 1, fitted(0.010, 0.002)) == [0]
    # A large batch: its step is no longer mostly fixed cost; a middling acceptance rate then does not pay.
    assert choose_draft_lengths([0.3] * 32, [4] * 32, 32, 32, fitted(0.010, 0.002)) == [0] * 32


def test_the_best_sequences_get_the_drafts_first():
    ks = choose_draft_lengths([0.95, 0.2], [4, 4], 2, 2, fitted(0.010, 0.001))
    assert ks[0] == 4 and ks[1] < ks[0]


def test_a_costly_draft_model_shortens_the_drafts():
    target = fitted(0.010, 0.0002)
    free = choose_draft_lengths([0.7], [8], 1, 1, target)
    costly = choose_draft_lengths([0.7], [8], 1, 1, target, draft=fitted(0.004, 0.0001))
    assert 0 < costly[0] < free[0]


def test_nothing_is_drafted_before_any_step_was_timed():
    assert choose_draft_lengths([0.9], [4], 1, 1, StepCosts()) == [0]


def test_a_gain_within_the_estimates_error_does_not_draft():
    # One step of 12 ms, 14 ms with a draft token: accepted with 0.19 it adds 2% tokens per second, below MIN_GAIN.
    assert choose_draft_lengths([0.19], [1], 1, 1, fitted(0.010, 0.002)) == [0]
    assert choose_draft_lengths([0.3], [1], 1, 1, fitted(0.010, 0.002)) == [1]
