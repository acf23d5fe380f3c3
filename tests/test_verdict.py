"""The verdict on hand-checkable inputs: intervals against scipy's own and by hand, words, the
stopping rule, the sentence, peak memory, bad inputs (moe_perf/stats/verdict.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from moe_perf.stats.interval import TRIM_FROM, abba, fit, trim_per_side
from moe_perf.stats.verdict import (
    DIFFERENT,
    FIRST_LOOK,
    SAME,
    UNKNOWN,
    Plan,
    Verdict,
    decide,
    decide_memory,
    describe,
    keep_adding,
)

FIXED = Plan(sequential=False)  # one look, all of alpha: the textbook interval


def medians(log_ratios, level=0.5):
    """Run medians whose log-ratios feat/base are exactly `log_ratios`."""
    d = np.asarray(log_ratios, dtype=float)
    return [level] * len(d), list(level * np.exp(d))


# --- the interval ----------------------------------------------------------------------------


def test_one_order_only_is_scipys_paired_t_interval():
    """All pairs base-first: no order to estimate, so the interval is the paired t-interval."""
    d = [0.01, 0.03, 0.02, 0.04]
    base, feat = medians(d)
    v = decide(base, feat, FIXED, feat_first=[False] * 4)
    ci = stats.ttest_1samp(d, 0.0).confidence_interval(0.95)
    assert math.log1p(v.estimate) == pytest.approx(0.025, abs=1e-12)
    assert math.log1p(v.low) == pytest.approx(ci.low, rel=1e-9)
    assert math.log1p(v.high) == pytest.approx(ci.high, rel=1e-9)
    # by hand: s = sqrt(0.0005/3), se = s/2, t(0.975, 3) = 3.182446
    assert math.log1p(v.low) == pytest.approx(0.025 - 3.182446 * math.sqrt(0.0005 / 3) / 2, 1e-6)
    assert (v.word, v.beyond_effect) == (DIFFERENT, False)


def test_abba_pairs_are_the_crossover_interval_by_hand():
    """ABBA at 4 pairs: the order effect is estimated and removed, one degree of freedom spent.

    Base-first pairs read 0.01 and 0.02, feat-first 0.03 and 0.04: the estimate is the mean of
    the two orders' means, 0.025; residuals +/-0.005 about each order's mean, SS = 1e-4,
    df = 4 - 2, se = sqrt(SS / (n * df)) = sqrt(1.25e-5); t(0.975, 2) = 4.302653.
    """
    base, feat = medians([0.01, 0.03, 0.02, 0.04])
    v = decide(base, feat, FIXED)
    half = 4.302653 * math.sqrt(1.25e-5)
    assert math.log1p(v.estimate) == pytest.approx(0.025, abs=1e-12)
    assert math.log1p(v.low) == pytest.approx(0.025 - half, rel=1e-6)
    assert math.log1p(v.high) == pytest.approx(0.025 + half, rel=1e-6)
    assert v.word == DIFFERENT and v.beyond_effect is False  # low 0.98%: not beyond 1%


def test_abba_interval_matches_least_squares_with_an_order_term():
    """Below TRIM_FROM pairs the fit is ordinary least squares of d on [1, order sign]: the same
    estimate and standard error as numpy's lstsq, with orders of equal size or not."""
    rng = np.random.default_rng(3)
    for n in range(3, TRIM_FROM):
        d = rng.normal(0.01, 0.02, n)
        signs = np.where(abba(n), 1.0, -1.0)
        x = np.column_stack([np.ones(n), signs])
        beta, ss, *_ = np.linalg.lstsq(x, d, rcond=None)
        se = math.sqrt(ss[0] / (n - 2) * np.linalg.inv(x.T @ x)[0, 0])
        got = fit(d[None, :], abba(n))
        assert got.estimate[0] == pytest.approx(beta[0], rel=1e-12)
        assert got.se[0] == pytest.approx(se, rel=1e-9)
        assert got.df == n - 2


def test_second_arm_bias_and_linear_drift_leave_the_interval_unchanged():
    """Both enter d as +b in one order and -b in the other: removed exactly from 3 pairs on."""
    rng = np.random.default_rng(4)
    for n in (3, 4, 7, 10):
        d = rng.normal(0.0, 0.01, n)
        biased = d + 0.05 * np.where(abba(n), 1.0, -1.0)
        plain, shifted = decide(*medians(d)), decide(*medians(biased))
        assert shifted.estimate == pytest.approx(plain.estimate, abs=1e-12)
        assert (shifted.low, shifted.high) == pytest.approx((plain.low, plain.high), abs=1e-12)


def test_trimmed_interval_is_yuens_from_scipys_trim_mean_and_winsorize():
    """From TRIM_FROM pairs one pair per side is trimmed: the estimate is scipy's trim_mean, the
    standard error Yuen's from mstats.winsorize (order not estimable: one order only)."""
    rng = np.random.default_rng(5)
    for n in (TRIM_FROM, 12, 20):
        d = rng.normal(0.0, 0.01, n)
        g = trim_per_side(n)
        h = n - 2 * g
        est = stats.trim_mean(d, g / n)
        s2 = np.var(np.asarray(stats.mstats.winsorize(d, limits=(g / n, g / n))), ddof=1)
        se = math.sqrt((n - 1) * s2 / (h * (h - 1)))
        got = fit(d[None, :], np.zeros(n, dtype=bool))
        assert (got.trimmed, got.df) == (g, h - 1 - g)  # one more per trimmed pair
        assert got.estimate[0] == pytest.approx(est, rel=1e-12)
        assert got.se[0] == pytest.approx(se, rel=1e-9)


def test_one_outlying_run_is_trimmed_from_trim_from_pairs():
    """A run 65% slow among pairs 2% apart: below TRIM_FROM it widens the interval (UNKNOWN,
    not a wrong word, and the reason names the pair); at TRIM_FROM it is trimmed."""
    d = [0.020, 0.021, 0.019, 0.50, 0.020, 0.022, 0.018, 0.021, 0.019, 0.020, 0.021, 0.020]
    before = decide(*medians(d[: TRIM_FROM - 1]))
    assert (before.word, before.trimmed) == (UNKNOWN, 0)
    assert "pair #3 lies far from the others" in before.reason
    after = decide(*medians(d[:TRIM_FROM]))
    assert (after.word, after.trimmed, after.beyond_effect) == (DIFFERENT, 1, True)
    assert after.estimate == pytest.approx(0.0204, abs=0.001)


# --- the words -------------------------------------------------------------------------------


def test_one_pair_is_unknown_with_no_spread():
    v = decide([1.0], [1.02])
    assert (v.word, v.pairs, v.low, v.high, v.more_pairs) == (UNKNOWN, 1, None, None, None)
    assert v.estimate == pytest.approx(0.02)
    assert v.reason == "one pair gives no run-to-run spread"


def test_max_pairs_one_can_never_decide_and_says_so():
    plan = Plan(max_pairs=1)
    v = decide([1.0], [1.5], plan)
    assert v.word == UNKNOWN and "compare.max_pairs=1" in v.reason
    assert not keep_adding(v, plan)


def test_one_fixed_repeat_names_the_repeats_not_max_pairs():
    """-m repeat=0 is one fixed pair: the remedy is more repeats, not compare.max_pairs."""
    v = decide([1.0], [1.5], Plan(max_pairs=1, sequential=False))
    assert v.word == UNKNOWN and "repeat" in v.reason and "max_pairs" not in v.reason


def test_same_when_the_interval_lies_inside_the_effect():
    base, feat = medians([0.001, -0.001, 0.0015, -0.0005, 0.0, 0.0005])
    v = decide(base, feat)
    assert v.word == SAME and v.beyond_effect is None
    assert -0.01 <= v.low < 0 < v.high <= 0.01
    assert v.reason == "the interval lies inside +/-1%"


def test_different_beyond_the_effect():
    base, feat = medians([0.021, 0.020, 0.022, 0.021])
    v = decide(base, feat)
    assert v.word == DIFFERENT and v.beyond_effect is True
    assert 0.01 < v.low < v.estimate < v.high


def test_a_sequential_plan_does_not_decide_before_its_first_look():
    base, feat = medians([0.20, 0.21, 0.20])  # plain as day, but alpha is not spent at 3 pairs
    v = decide(base, feat)
    assert v.word == UNKNOWN and f"first look is at {FIRST_LOOK} pairs" in v.reason
    assert v.low is not None and v.low > 0  # drawn at the first look's rate, to show progress
    assert v.more_pairs == 1
    assert decide(*medians([0.20, 0.21, 0.20, 0.21])).word == DIFFERENT


def test_unknown_says_about_how_many_more_pairs_would_decide_it():
    """Projected with the spread held: the same four pairs repeated to that count decide it."""
    d = [0.010, 0.003, -0.004, 0.012]
    v = decide(*medians(d))
    assert v.word == UNKNOWN and v.more_pairs and v.more_pairs > 0
    assert f"about {v.more_pairs} more pair" in v.reason
    target = 4 + v.more_pairs
    longer = (d * target)[:target]
    plan = Plan(max_pairs=max(target, 10))
    assert decide(*medians(longer), plan).word != UNKNOWN
    mean = sum(d) / 4
    noisier = decide(*medians([mean + 4 * (x - mean) for x in d]))
    assert noisier.more_pairs > v.more_pairs


def test_at_max_pairs_unknown_names_the_override_that_would_decide_it():
    rng = np.random.default_rng(6)
    v = decide(*medians(rng.normal(0, 0.015 * math.sqrt(2), 10)), Plan(max_pairs=10))
    assert v.word == UNKNOWN
    assert "stopped at compare.max_pairs=10" in v.reason
    assert f"(compare.max_pairs={10 + v.more_pairs})" in v.reason


# --- the plan and the stopping rule ----------------------------------------------------------


def test_sequential_plan_spends_alpha_evenly_over_its_looks():
    plan = Plan(confidence=0.95, max_pairs=10)
    spent = [plan.alpha_at(n) for n in range(1, 11)]
    assert spent[: FIRST_LOOK - 1] == [0.0] * (FIRST_LOOK - 1)
    assert spent[FIRST_LOOK - 1 :] == pytest.approx([0.05 / 7] * 7)
    assert sum(spent) == pytest.approx(0.05)
    assert plan.alpha_at(14) == pytest.approx(0.05 / 11)  # past the plan: stricter
    assert FIXED.alpha_at(2) == FIXED.alpha_at(9) == pytest.approx(0.05)
    assert Plan(max_pairs=2).alpha_at(2) == pytest.approx(0.05)  # one look, at 2 pairs
    assert Plan(max_pairs=1).alpha_at(1) == 0.0


def test_keep_adding_until_decided_or_at_max_pairs():
    plan = Plan(max_pairs=6)
    undecided = decide(*medians([0.01, -0.02, 0.03, 0.0]), plan)
    assert undecided.word == UNKNOWN and keep_adding(undecided, plan)
    assert not keep_adding(decide(*medians([0.021, 0.020, 0.022, 0.021]), plan), plan)
    at_cap = decide(*medians([0.01, -0.02, 0.03, 0.0, 0.02, -0.01]), plan)
    assert at_cap.word == UNKNOWN and not keep_adding(at_cap, plan)
    fixed = Plan(max_pairs=6, sequential=False)  # fixed repeats run all their pairs
    assert keep_adding(decide(*medians([0.2, 0.21, 0.2]), fixed), fixed)


@pytest.mark.parametrize(
    "kwargs, override",
    [
        ({"effect": 0}, "compare.effect"),
        ({"effect": 1.5}, "compare.effect"),
        ({"confidence": 1.0}, "compare.confidence"),
        ({"max_pairs": 0}, "compare.max_pairs"),
        ({"max_pairs": 2.5}, "compare.max_pairs"),
        ({"max_pairs": True}, "compare.max_pairs"),
    ],
)
def test_a_bad_plan_names_its_override(kwargs, override):
    with pytest.raises(ValueError, match=override):
        Plan(**kwargs)


# --- inputs that cannot be trusted ----------------------------------------------------------


@pytest.mark.parametrize(
    "base, feat, message",
    [
        ([1.0, float("nan")], [1.0, 1.0], r"base run median #1 is nan"),
        ([1.0, 1.0], [1.0, 0.0], r"feat run median #1 is 0\.0"),
        ([-1.0], [1.0], r"base run median #0 is -1\.0"),
        ([1.0], [float("inf")], r"feat run median #0 is inf"),
        (["1.0"], [1.0], r"not a number"),
        ([True], [1.0], r"not a number"),
        ([1.0, 1.0], [1.0], r"2 base and 1 feat"),
        ([], [], r"no pairs"),
    ],
)
def test_untrustworthy_inputs_are_rejected(base, feat, message):
    with pytest.raises(ValueError, match=message):
        decide(base, feat)


def test_feat_first_must_cover_every_pair():
    with pytest.raises(ValueError, match="feat_first has 2 entries for 3 pairs"):
        decide([1, 1, 1], [1, 1, 1], feat_first=[False, True])


# --- the record and the sentence -------------------------------------------------------------


def test_to_dict_from_dict_round_trip_through_json():
    for v in (
        decide(*medians([0.021, 0.020, 0.022, 0.021])),
        decide([1.0], [1.1]),
        decide_memory([40.0], [41.0]),
    ):
        assert Verdict.from_dict(json.loads(json.dumps(v.to_dict()))) == v


def verdict(**overrides) -> Verdict:
    fields = dict(
        word=DIFFERENT, estimate=0.021, low=0.016, high=0.026, confidence=0.95, effect=0.01,
        pairs=4, beyond_effect=True, reason="the interval excludes zero", more_pairs=None,
        trimmed=0,
    )  # fmt: skip
    return Verdict(**{**fields, **overrides})


def test_describe_different_same_and_unknown():
    assert (
        describe(verdict(), "slower", "faster")
        == "2.1% slower (95% CI 1.6 to 2.6%, 4 pairs): DIFFERENT, beyond the 1% effect"
    )
    assert (
        describe(verdict(estimate=-0.021, low=-0.026, high=-0.016), "faster", "slower")
        == "2.1% slower (95% CI 1.6 to 2.6%, 4 pairs): DIFFERENT, beyond the 1% effect"
    )
    within = verdict(estimate=0.004, low=0.002, high=0.006, beyond_effect=False, pairs=8)
    assert (
        describe(within, "slower", "faster")
        == "0.40% slower (95% CI 0.20 to 0.60%, 8 pairs): DIFFERENT, within the 1% effect"
    )
    same = verdict(word=SAME, estimate=-0.0005, low=-0.004, high=0.003, beyond_effect=None, pairs=5)
    assert (
        describe(same, "slower", "faster")
        == "no change beyond 1% (95% CI -0.40 to +0.30%, 5 pairs): SAME"
    )
    unknown = verdict(
        word=UNKNOWN, estimate=0.008, low=-0.031, high=0.049, pairs=2, beyond_effect=None,
        reason="this plan's first look is at 4 pairs; about 3 more pairs would decide it",
        more_pairs=3,
    )  # fmt: skip
    assert describe(unknown, "slower", "faster") == (
        "UNKNOWN: +0.8% (95% CI -3.1 to +4.9%, 2 pairs): this plan's first look is at 4 "
        "pairs; about 3 more pairs would decide it"
    )


def test_describe_reads_a_real_verdict_with_its_trim_and_confidence():
    d = [0.020, 0.021, 0.019, 0.50, 0.020, 0.022, 0.018, 0.021, 0.019, 0.020]
    text = describe(decide(*medians(d), Plan(confidence=0.999)), "slower", "faster")
    assert text.startswith("2.0% slower (99.9% CI ")
    assert text.endswith(", 10 pairs, 1 trimmed each side): DIFFERENT, beyond the 1% effect")
    assert describe(decide([1.0], [1.02]), "slower", "faster") == (
        "UNKNOWN: +2.0% (1 pair): one pair gives no run-to-run spread"
    )


def test_describe_reads_peak_memory_verdicts_without_an_interval():
    more = decide_memory([40.0, 40.0], [41.0, 41.0])
    assert describe(more, "more memory", "less memory") == (
        "2.5% more memory (2 pairs): DIFFERENT, beyond the 1% effect"
    )
    same = decide_memory([40.0], [40.1])
    assert describe(same, "more memory", "less memory") == "no change beyond 1% (1 pair): SAME"


# --- peak memory -----------------------------------------------------------------------------


def test_memory_same_within_tolerance_different_beyond():
    same = decide_memory([40.00, 40.02, 40.00], [40.10, 40.10, 40.12], tolerance=0.005)
    assert same.word == SAME and same.estimate == pytest.approx(0.1 / 40.0)
    different = decide_memory([40.0, 40.0], [40.5, 40.5], tolerance=0.005)
    assert different.word == DIFFERENT and different.beyond_effect is True
    assert different.reason == "medians 40 and 40.5: +1.25%, beyond the 0.5% tolerance"
    assert decide_memory([40.0] * 3, [40.0, 99.0, 40.0]).word == SAME  # medians: one run odd
    assert decide_memory([40.0, 40.0, 40.0], [40.0]).word == SAME  # a run may lack the figure


def test_memory_rejects_untrustworthy_inputs():
    with pytest.raises(ValueError, match="feat run median #0 is nan"):
        decide_memory([40.0], [float("nan")])
    with pytest.raises(ValueError, match="at least one run median of each arm"):
        decide_memory([40.0], [])
    with pytest.raises(ValueError, match="compare.memory_tolerance"):
        decide_memory([40.0], [40.0], tolerance=-0.1)
