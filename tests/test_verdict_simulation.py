"""The verdict's error rates, measured on simulated sweeps (moe_perf/stats/simulate.py).

Each case runs SWEEPS seeded sweeps that add pairs exactly as the sweeper does. A rate measured
over N sweeps is bounded by its nominal value plus three Monte-Carlo standard errors,
alpha + 3 * sqrt(alpha * (1 - alpha) / N): about 0.0646 for alpha = 0.05 and N = 2,000.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from moe_perf.stats.simulate import SIGMAS, Case, nuisances, run_medians, simulate, sweep
from moe_perf.stats.verdict import DIFFERENT, SAME, UNKNOWN, Plan, decide, keep_adding

SWEEPS = 2000
PLAN = Plan()  # the defaults: effect 1%, confidence 0.95, max_pairs from the table
CASES = [
    (name, sigma, nuisance, fields)
    for name, sigma in SIGMAS.items()
    for nuisance, fields in nuisances(sigma).items()
]
IDS = [f"{name}-{nuisance}" for name, _, nuisance, _ in CASES]


def bound(alpha: float, sweeps: int = SWEEPS) -> float:
    return alpha + 3 * math.sqrt(alpha * (1 - alpha) / sweeps)


@pytest.mark.parametrize("name, sigma, nuisance, fields", CASES, ids=IDS)
def test_aa_is_different_at_most_at_the_nominal_rate(name, sigma, nuisance, fields):
    outcome = simulate(Case(sigma, 0.0, **fields), PLAN, SWEEPS, seed=1)
    assert outcome.rate(DIFFERENT) <= bound(PLAN.alpha), outcome


@pytest.mark.parametrize("name, sigma, nuisance, fields", CASES, ids=IDS)
def test_twice_the_effect_is_almost_never_called_same(name, sigma, nuisance, fields):
    """SAME needs the simultaneous interval to miss the change by more than the effect: at most
    alpha/2 in theory. Measured (docs/verdict.md): at most 9 in 20,000 sweeps, at 1.5% spread
    (4 pairs whose spread came out small by chance), so up to 5 in 2,000 pass and a rule
    that misses more often than 1 in 400 fails."""
    for sign in (+1, -1):
        outcome = simulate(Case(sigma, sign * 2 * PLAN.effect, **fields), PLAN, SWEEPS, seed=2)
        assert outcome.count(SAME) <= 5, outcome


@pytest.mark.parametrize("pairs", [2, 3, 4, 6, 9, 10, 11, 12, 16, 20])
@pytest.mark.parametrize("confidence", [0.95, 0.99])
def test_fixed_repeats_aa_is_different_at_most_at_the_nominal_rate(pairs, confidence):
    """One look with all of alpha: each count's interval must hold on its own, trimmed or not
    (10 pairs, the first trimmed count, is where Yuen's interval alone was most liberal)."""
    plan = Plan(confidence=confidence, max_pairs=pairs, sequential=False)
    outcome = simulate(Case(0.01, 0.0), plan, 4 * SWEEPS, seed=pairs)
    assert outcome.mean_pairs == pairs  # fixed repeats run every pair
    assert outcome.rate(DIFFERENT) <= bound(plan.alpha, 4 * SWEEPS), outcome


def test_a_stricter_confidence_makes_false_alarms_rarer():
    """compare.confidence=0.999: the false alarms of an A/A fall under 1 in 1,000."""
    plan = Plan(confidence=0.999)
    outcome = simulate(Case(0.003, 0.0, **nuisances(0.003)["all at once"]), plan, 4000, seed=3)
    assert outcome.count(DIFFERENT) <= 4, outcome


@dataclass(frozen=True)
class LookingWithoutSpending(Plan):
    """The rule without its correction: every look at the full error rate."""

    def alpha_at(self, pairs: int) -> float:
        return self.alpha if pairs >= self.first_look else 0.0


def test_the_bound_catches_a_rule_that_looks_without_spending():
    """The A/A test can fail: looking after every pair at the full rate inflates false alarms."""
    naive = LookingWithoutSpending(max_pairs=PLAN.max_pairs)
    outcome = simulate(Case(0.10, 0.0), naive, SWEEPS, seed=1)
    assert outcome.rate(DIFFERENT) > bound(PLAN.alpha), outcome
    assert simulate(Case(0.10, 0.0), PLAN, SWEEPS, seed=1).rate(DIFFERENT) < bound(PLAN.alpha)


@pytest.mark.parametrize(
    "sigma, change, word, at_least",
    [
        (0.003, 0.04, DIFFERENT, 0.99),  # 4x the effect at the reference trainer's spread
        (0.003, 0.01, DIFFERENT, 0.95),  # 1x
        (0.003, 0.0, SAME, 0.95),  # an A/A is settled
        (0.015, 0.04, DIFFERENT, 0.90),  # 4x at torchtitan's spread
    ],
)
def test_power_within_max_pairs(sigma, change, word, at_least):
    outcome = simulate(Case(sigma, change), PLAN, SWEEPS, seed=4)
    assert outcome.rate(word) >= at_least, outcome
    assert outcome.mean_pairs < PLAN.max_pairs


def test_outliers_slow_a_decision_but_do_not_stop_it():
    """One run in 20 slow by 10 sigma: the 4x change is still read, from the trimmed pairs."""
    fields = nuisances(0.003)["outliers"]
    outcome = simulate(Case(0.003, 0.04, **fields), PLAN, SWEEPS, seed=5)
    assert outcome.rate(DIFFERENT) >= 0.95, outcome


def test_a_planted_twenty_percent_slowdown_is_decided_at_the_first_look():
    """At CPU-like spread (3% per run) and a 3% second-arm bias, 20% is read at 4-5 pairs."""
    outcome = simulate(Case(0.03, 0.20, second_arm_bias=0.03), PLAN, SWEEPS, seed=6)
    assert outcome.rate(DIFFERENT) == 1.0
    assert outcome.mean_pairs <= PLAN.first_look + 1


def test_the_simulated_sweep_is_the_sweepers_loop_over_decide():
    """The vectorized sweep gives, sweep for sweep, the words and pair counts of the sweeper's
    own loop: decide after each pair, keep_adding to go on."""
    case = Case(0.003, 0.01, **nuisances(0.003)["all at once"])
    base, feat = run_medians(case, PLAN.max_pairs, 100, np.random.default_rng(7))
    words, pairs = sweep(base, feat, PLAN)
    for i in range(len(base)):
        n = 1
        verdict = decide(base[i, :n], feat[i, :n], PLAN)
        while keep_adding(verdict, PLAN):
            n += 1
            verdict = decide(base[i, :n], feat[i, :n], PLAN)
        assert (verdict.word, verdict.pairs) == (words[i], pairs[i]), i
    assert {SAME, DIFFERENT, UNKNOWN} >= set(words) and len(set(words)) >= 2
