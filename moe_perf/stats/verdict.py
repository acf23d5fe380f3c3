"""SAME, DIFFERENT or UNKNOWN: feat against base from run medians in pairs, at a stated effect.

The unit of evidence is one run's median (steps are never pooled); pair i = (base[i], feat[i])
ran back to back, in ABBA order (interval.abba). The interval is interval.fit's; this module
turns it into a word at the confidence that a Plan spends at each look:

* DIFFERENT: the interval excludes zero (and says whether it lies beyond +/-effect);
* SAME: the interval lies inside +/-effect;
* UNKNOWN: neither, with why and about how many more pairs would decide it.

A sequential plan (pairs added until decided) looks after every pair from FIRST_LOOK on and
spends the error rate evenly over those looks (Bonferroni), so the intervals hold together over
the whole sweep: a 95% plan's interval is a simultaneous 95% interval over its looks.
Validated by simulation: moe_perf/stats/simulate.py, tests/test_verdict_simulation.py,
docs/verdict.md. The words, the Verdict and its sentence: moe_perf/stats/words.py.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from moe_perf.stats.interval import (
    TRIM_FROM,
    LogRatioFit,
    abba,
    degrees_of_freedom,
    far_pair,
    fit,
    t_quantile,
)
from moe_perf.stats.words import (
    DIFFERENT,
    SAME,
    UNKNOWN,
    Verdict,
    pct,
    setting,
    signed,
)
from moe_perf.stats.words import describe as describe  # the verdict's sentence, importable here

# The first pair count that a sequential plan may decide at. With the order modelled, 2 and 3
# pairs leave 0 and 1 degrees of freedom: at a per-look error of 0.05/7 the t quantile with one
# degree of freedom is 89 standard errors, so error rate spent there would buy nothing (looking
# from 2 or 3 pairs measured worse; from 5, a pair later on large changes: docs/verdict.md).
FIRST_LOOK = 4
# compare.max_pairs's default, chosen from the simulation table (docs/verdict.md): at 10 pairs
# the reference trainer's A/A (0.3% per-run spread) is SAME 98% of the time, in 6.2 pairs on
# average, a 1% change DIFFERENT 99%, and a 4% change at torchtitan's 1.5% spread DIFFERENT 93%.
# 12 pairs adds 1-4 points to these and 2 pairs to every sweep that stays UNKNOWN (most sweeps
# at 1.5% and 10% spread with a 1% effect); 8 pairs loses 2-4 points.
DEFAULT_MAX_PAIRS = 10
# compare.memory_tolerance's default. The caching allocator's max reserved memory came out the
# same in both arms of the GPU A/As in docs/benchmarks.md (49.79 GiB in every Megatron-LM arm,
# 100.27 GiB in both torchtitan arms); on CPU the peak is a process's max RSS, which spread 1.0%
# over five processes of one small torch training loop (400.1-404.0 MiB, torch 2.13 CPU, the
# project's 2-core VM). 1% is 0.8 GiB on an 80 GiB card: below a change that moves an
# out-of-memory line, above the CPU's noise once medians are taken.
MEMORY_TOLERANCE = 0.01
# How far the projection of "how many more pairs" looks before calling it not estimable.
PROJECTION_LIMIT = 1000


@dataclass(frozen=True)
class Plan:
    """How a sweep looks at its data: the effect that matters, the confidence, the looks."""

    effect: float = 0.01  # compare.effect: smallest relative change that matters
    confidence: float = 0.95  # compare.confidence: holds across every look of the sweep
    max_pairs: int = DEFAULT_MAX_PAIRS  # compare.max_pairs
    sequential: bool = True  # True: a look after every pair; False: fixed repeats, one look

    def __post_init__(self) -> None:
        if not (isinstance(self.effect, numbers.Real) and 0 < self.effect < 1):
            raise ValueError(f"compare.effect={self.effect!r}: a relative change in (0, 1)")
        if not (isinstance(self.confidence, numbers.Real) and 0 < self.confidence < 1):
            raise ValueError(f"compare.confidence={self.confidence!r}: a probability in (0, 1)")
        if isinstance(self.max_pairs, bool) or not isinstance(self.max_pairs, numbers.Integral):
            raise ValueError(f"compare.max_pairs={self.max_pairs!r}: a whole number of pairs")
        if self.max_pairs < 1:
            raise ValueError(f"compare.max_pairs={self.max_pairs}: at least 1 pair")

    @property
    def alpha(self) -> float:
        """The error rate of the whole sweep."""
        return 1.0 - self.confidence

    @property
    def first_look(self) -> int:
        """The fewest pairs this plan can decide at (2 pairs give the first spread)."""
        if not self.sequential:
            return 2
        return max(2, min(FIRST_LOOK, self.max_pairs))

    @property
    def looks(self) -> int:
        """How many looks a sequential plan spends alpha over (fixed repeats: one)."""
        if not self.sequential:
            return 1
        return max(0, self.max_pairs - self.first_look + 1)

    def alpha_at(self, pairs):
        """The error rate spent at a look with `pairs` pairs (0: this plan does not decide there).

        Fixed repeats spend all of it at their one look. A sequential plan spends it evenly over
        its looks, first_look..max_pairs; data beyond max_pairs (a record read under a smaller
        plan, or a projection) is judged as if the plan had reached that far: stricter. `pairs`
        may be an array of counts.
        """
        pairs = np.asarray(pairs)
        if not self.sequential:
            spent = np.where(pairs >= 2, self.alpha, 0.0)
        else:
            looks = np.maximum(pairs, self.max_pairs) - self.first_look + 1
            spent = np.where(pairs >= self.first_look, self.alpha / np.maximum(looks, 1), 0.0)
        return float(spent) if spent.ndim == 0 else spent


@dataclass(frozen=True)
class Look:
    """The words of S comparisons at one pair count: what the sweeper and the simulation read."""

    pairs: int
    fit: LogRatioFit | None  # None with one pair: no spread
    alpha: float  # the error rate the interval is drawn at
    low: np.ndarray  # (S,) log scale, -inf where there is no spread
    high: np.ndarray
    words: np.ndarray  # (S,) SAME / DIFFERENT / UNKNOWN


def look(
    d: np.ndarray,
    feat_first: np.ndarray,
    plan: Plan,
    fitter: Callable[[np.ndarray, np.ndarray], LogRatioFit] = fit,
) -> Look:
    """The interval and word of log-ratios `d` (S, n) under `plan`.

    Before the plan's first look the interval is drawn at the first look's error rate, to show
    where the sweep stands, and the word stays UNKNOWN. `fitter`: interval.fit, or another
    estimator to compare with it (bench/verdict_table.py).
    """
    n = d.shape[1]
    if n < 2:
        inf = np.full(len(d), np.inf)
        return Look(n, None, 0.0, -inf, inf, np.full(len(d), UNKNOWN))
    result = fitter(d, feat_first)
    alpha = plan.alpha_at(n) or plan.alpha_at(plan.first_look)
    half = result.half_width(alpha)
    low, high = result.estimate - half, result.estimate + half
    words = words_of(low, high, plan.effect) if plan.alpha_at(n) > 0 else np.full(len(d), UNKNOWN)
    return Look(n, result, alpha, low, high, words)


def words_of(low: np.ndarray, high: np.ndarray, effect: float) -> np.ndarray:
    """The rule itself, on log-scale interval bounds: DIFFERENT, else SAME, else UNKNOWN."""
    different = (low > 0) | (high < 0)
    same = (low >= math.log1p(-effect)) & (high <= math.log1p(effect))
    return np.where(different, DIFFERENT, np.where(same, SAME, UNKNOWN))


def undecided(words, pairs: int, plan: Plan):
    """The stopping rule, elementwise: add a pair while UNKNOWN and below max_pairs.

    Fixed repeats run all their pairs whatever the interim words: their one look is the last.
    """
    if not plan.sequential:
        return np.full(np.shape(words), pairs < plan.max_pairs)
    return (np.asarray(words) == UNKNOWN) & (pairs < plan.max_pairs)


def keep_adding(verdict: Verdict, plan: Plan) -> bool:
    """The sweeper's and the simulation's one stopping rule: False once decided or at max_pairs."""
    return bool(undecided(verdict.word, verdict.pairs, plan))


# --------------------------------------------------------------------------------------------
# One comparison: inputs checked, the word explained


def decide(
    base: Sequence[float],
    feat: Sequence[float],
    plan: Plan = Plan(),
    feat_first: Sequence[bool] | None = None,
) -> Verdict:
    """The verdict of paired run medians; `feat_first[i]`: pair i ran feat first (default ABBA)."""
    d = log_ratios(base, feat)
    order = abba(len(d)) if feat_first is None else _order(feat_first, len(d))
    seen = look(d[None, :], order, plan)
    return _verdict(seen, plan, d, order)


def log_ratios(base: Sequence[float], feat: Sequence[float]) -> np.ndarray:
    """ln(feat_i / base_i) per pair; a value that cannot be trusted stops here (ValueError)."""
    b, f = _values(base, "base"), _values(feat, "feat")
    if len(b) != len(f):
        raise ValueError(f"{len(b)} base and {len(f)} feat run medians: pairs need one of each")
    if not len(b):
        raise ValueError("no pairs: a verdict needs at least one base and one feat run median")
    return np.log(f) - np.log(b)


def _values(values: Sequence[float], arm: str) -> np.ndarray:
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ValueError(f"{arm} run median #{i} is {v!r}: not a number")
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{arm} run median #{i} is {v!r}: a run median must be finite and > 0")
        out.append(float(v))
    return np.array(out)


def _order(feat_first: Sequence[bool], n: int) -> np.ndarray:
    order = np.array([bool(x) for x in feat_first])
    if len(order) != n:
        raise ValueError(f"feat_first has {len(order)} entries for {n} pairs")
    return order


def _verdict(seen: Look, plan: Plan, d: np.ndarray, order: np.ndarray) -> Verdict:
    n, word = seen.pairs, str(seen.words[0])
    estimate = float(np.expm1(seen.fit.estimate[0])) if seen.fit else float(np.expm1(d[0]))
    bounded = math.isfinite(seen.low[0]) and math.isfinite(seen.high[0])
    low = float(np.expm1(seen.low[0])) if bounded else None
    high = float(np.expm1(seen.high[0])) if bounded else None
    beyond = None
    if word == DIFFERENT:
        beyond = bool(min(abs(low), abs(high)) > plan.effect)
    more = _more_pairs(seen, plan) if word == UNKNOWN else None
    return Verdict(
        word=word,
        estimate=estimate,
        low=low,
        high=high,
        confidence=plan.confidence,
        effect=plan.effect,
        pairs=n,
        beyond_effect=beyond,
        reason=_reason(word, seen, plan, low, more, far_pair(d, order)),
        more_pairs=more,
        trimmed=seen.fit.trimmed if seen.fit else 0,
    )


def _more_pairs(seen: Look, plan: Plan) -> int | None:
    """About how many more pairs would decide it, the estimate and spread staying as they are.

    The standard error shrinks as 1/sqrt(pairs); each later look has its own degrees of freedom
    and error rate (past max_pairs: the rate of the same plan with max_pairs raised that far).
    """
    if seen.fit is None or not math.isfinite(seen.fit.se[0]):
        return None
    n = seen.pairs
    start = max(n + 1, plan.first_look)
    for stop in (n + 50, n + PROJECTION_LIMIT):  # most are decided within 50: one short look
        later = np.arange(start, stop + 1)
        decided = _decided_at(later, seen.fit, n, plan)
        if decided.any():
            return int(later[decided.argmax()] - n)
        start = stop + 1
    return None


def _decided_at(later: np.ndarray, now: LogRatioFit, n: int, plan: Plan) -> np.ndarray:
    dfs = degrees_of_freedom(later, now.order_modelled)
    quantile = t_quantile(1 - plan.alpha_at(later) / 2, np.maximum(dfs, 1))
    half = np.where(dfs >= 1, quantile * now.se[0] * np.sqrt(n / later), np.inf)
    centre = now.estimate[0]
    return words_of(centre - half, centre + half, plan.effect) != UNKNOWN


def _reason(word, seen: Look, plan: Plan, low, more: int | None, far: int | None) -> str:
    effect = setting(plan.effect)
    if word == SAME:
        return f"the interval lies inside +/-{effect}"
    if word == DIFFERENT:
        return "the interval excludes zero"
    if plan.max_pairs < 2:
        return f"{_one_pair_remedy(plan)} for a verdict"
    if seen.pairs < 2:
        return "one pair gives no run-to-run spread"
    why = _unknown_why(seen, plan, low)
    if far is not None and seen.fit.trimmed == 0:
        why += f"; pair #{far} lies far from the others (trimmed from {TRIM_FROM} pairs on)"
    return why + _what_would_decide(seen, plan, more)


def _one_pair_remedy(plan: Plan) -> str:
    """Why a plan of one pair never decides, and the setting that changes it."""
    if not plan.sequential:  # -m repeat=0: fixed repeats, one of them
        return ("one fixed repeat runs one pair, which gives no run-to-run spread: leave repeat "
                "at auto (the default) or sweep several, e.g. -m repeat=0,1,2,3")  # fmt: skip
    return ("compare.max_pairs=1 runs one pair, which gives no run-to-run spread: "
            f"set compare.max_pairs={max(FIRST_LOOK, DEFAULT_MAX_PAIRS)}")  # fmt: skip


def _unknown_why(seen: Look, plan: Plan, low) -> str:
    if plan.alpha_at(seen.pairs) == 0:
        return f"this plan's first look is at {plan.first_look} pairs"
    if low is None:
        return "no spread to measure yet"
    spread = pct(_pair_spread(seen), 2)
    effect = setting(plan.effect)
    return f"the interval holds both no change and a change of {effect} (pairs spread {spread})"


def _pair_spread(seen: Look) -> float:
    """The standard deviation of one pair's log-ratio implied by the standard error."""
    return float(seen.fit.se[0] * math.sqrt(seen.pairs))


def _what_would_decide(seen: Look, plan: Plan, more: int | None) -> str:
    at_cap = plan.sequential and seen.pairs >= plan.max_pairs
    cap = f"; stopped at compare.max_pairs={plan.max_pairs}" if at_cap else ""
    if more is None:
        return cap + f"; more than {PROJECTION_LIMIT} more pairs at this spread"
    target = seen.pairs + more
    raise_cap = f" (compare.max_pairs={target})" if target > plan.max_pairs else ""
    return f"{cap}; about {more} more pair{'s' if more > 1 else ''} would decide it{raise_cap}"


# --------------------------------------------------------------------------------------------
# Peak memory: no interval, a tolerance


def decide_memory(
    base: Sequence[float], feat: Sequence[float], tolerance: float = MEMORY_TOLERANCE
) -> Verdict:
    """Peak memory: the arms' medians within `tolerance` (relative) are SAME, else DIFFERENT.

    Peak memory repeats to the allocator's granularity rather than scattering like step time,
    so a tolerance, not an interval, separates a change from noise. The arms need not have as
    many runs each (a run may lack the figure).
    """
    if not (isinstance(tolerance, numbers.Real) and 0 <= tolerance < 1):
        raise ValueError(f"compare.memory_tolerance={tolerance!r}: a relative change in [0, 1)")
    b, f = _values(base, "base"), _values(feat, "feat")
    if not len(b) or not len(f):
        raise ValueError("peak memory needs at least one run median of each arm")
    mb, mf = float(np.median(b)), float(np.median(f))
    change = mf / mb - 1
    word = SAME if abs(change) <= tolerance else DIFFERENT
    side = "inside" if word == SAME else "beyond"
    return Verdict(
        word=word,
        estimate=change,
        low=None,
        high=None,
        confidence=1.0,
        effect=float(tolerance),
        pairs=min(len(b), len(f)),
        beyond_effect=(word == DIFFERENT) or None,
        reason=f"medians {mb:.4g} and {mf:.4g}: {signed(change, 2)}, {side} the "
        f"{setting(tolerance)} tolerance",
        more_pairs=None,
        trimmed=0,
    )
