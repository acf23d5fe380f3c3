"""The interval of feat against base from paired run medians: one home for the arithmetic.

Legend: arrays are (S, n): S comparisons at once (S=1 for one comparison, many in the
simulation), n pairs each; everything is on the log scale, d = ln(feat/base).

The estimator (docs/design.md, "The verdict"): the two-period crossover's analysis with a trim.
Pairs run in ABBA order, so each pair belongs to one of two orders (base first, feat first).
A second-arm bias b (the second run of a pair faster) and a linear drift both enter d as +b in
one order and -b in the other. Half the difference of the two orders' mean (when trimming:
median) log-ratios estimates b; removing it leaves order-balanced log-ratios, whose trimmed
mean is the estimate and whose winsorized spread gives Yuen's (Tukey-McLaughlin) standard
error, with one degree of freedom spent on the order. No trimming below TRIM_FROM pairs: there
it is the crossover's t-interval.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Trimming one pair per side costs three degrees of freedom (see degrees_of_freedom), which at a
# handful of pairs and the looks' small error rates widens the interval more than an occasional
# outlier does. Simulated (docs/verdict.md, "The design choices"): trimming from 5, 6, 8 or 10
# pairs reads the outlier cases alike (71-73% of outlier-ridden A/As SAME, never trimming 54%),
# and from 10 decides the most clean ones (98% SAME against 92-94%). Below this count one
# outlying pair widens the interval (UNKNOWN, never a wrong word); from here it is trimmed.
TRIM_FROM = 10


def t_quantile(q, df):
    """Student's t quantile (arrays too): the intervals' one use of scipy."""
    # imported here: scipy.stats costs about half a second to import, which every command
    # refused before it runs (a bad override, a dirty tree) would otherwise pay
    from scipy import stats

    return stats.t.ppf(q, df)


def abba(pairs: int) -> np.ndarray:
    """Which pairs run feat first: pair 0 base then feat, pair 1 feat then base, and so on."""
    return np.arange(pairs) % 2 == 1


def trim_per_side(pairs):
    """Pairs trimmed on each side: one from TRIM_FROM pairs, 10% from 20 pairs on (arrays too)."""
    g = np.where(np.asarray(pairs) < TRIM_FROM, 0, np.maximum(1, np.asarray(pairs) // 10))
    return int(g) if g.ndim == 0 else g


@dataclass(frozen=True)
class LogRatioFit:
    """The estimate of ln(feat/base) and its standard error, S comparisons at once."""

    estimate: np.ndarray  # (S,)
    se: np.ndarray  # (S,); 0 where every pair agrees
    df: int  # degrees of freedom of the t quantile; 0: no spread to measure
    trimmed: int  # pairs trimmed on each side
    order_modelled: bool  # True: the second-arm bias was estimated and removed

    def half_width(self, alpha: float) -> np.ndarray:
        """Half-width of the two-sided (1 - alpha) t interval, inf where there is no spread."""
        if self.df < 1 or alpha <= 0:
            return np.full_like(self.estimate, np.inf)
        return t_quantile(1 - alpha / 2, self.df) * self.se


def fit(d: np.ndarray, feat_first: np.ndarray) -> LogRatioFit:
    """The order-balanced, trimmed mean of log-ratios `d` (S, n) with its standard error."""
    n = d.shape[1]
    signs = _order_signs(feat_first)
    g = trim_per_side(n)
    balanced, factor = _remove_order(d, signs, robust=g > 0) if signs is not None else (d, 1.0)
    estimate, winsorized_ss = _trimmed_and_winsorized(balanced, g)
    kept = n - 2 * g
    parameters = 2 if signs is not None else 1
    df = degrees_of_freedom(n, signs is not None)
    spread_df = kept - parameters  # Yuen's: the kept pairs less the fitted parameters
    if spread_df < 1:
        return LogRatioFit(estimate, np.full(len(d), np.inf), 0, g, signs is not None)
    se = np.sqrt(factor * winsorized_ss / (kept * spread_df))
    return LogRatioFit(estimate, se, df, g, signs is not None)


def degrees_of_freedom(pairs, order_modelled: bool):
    """Of the t quantile: the kept pairs, less the fitted parameters, less one per pair trimmed
    on each side (`pairs` may be an array of counts).

    Yuen's kept - 1 is liberal at these counts in the far tails the sequential looks use: with
    one pair trimmed per side, a fixed 10-pair A/A read DIFFERENT 1.05x (95%) and 1.36x (99.5%)
    as often as nominal, 20 pairs 1.09x and 1.16x. Spending one more degree of freedom per
    trimmed pair brings every count from 10 to 30 pairs to at most the nominal rate within the
    simulation's error (docs/verdict.md, "Per-look error").
    """
    g = trim_per_side(pairs)
    df = np.maximum(0, np.asarray(pairs) - 3 * g - (2 if order_modelled else 1))
    return int(df) if df.ndim == 0 else df


def _order_signs(feat_first: np.ndarray) -> np.ndarray | None:
    """+1 for feat-first pairs, -1 for base-first; None when the order cannot be estimated.

    Two pairs leave no spread once the order is estimated; a sweep run in one order only
    (no ABBA) cannot tell a second-arm bias from the change, so it goes in the estimate.
    """
    feat_first = np.asarray(feat_first, dtype=bool)
    if len(feat_first) < 3 or feat_first.all() or not feat_first.any():
        return None
    return np.where(feat_first, 1.0, -1.0)


def _remove_order(d: np.ndarray, signs: np.ndarray, robust: bool) -> tuple[np.ndarray, float]:
    """Log-ratios with the order effect removed, and the variance factor of the balanced mean.

    Untrimmed, the order effect is half the difference of the orders' means: the fit is then
    least squares of d on [1, order sign], the crossover's exact t-interval under normal noise.
    Trimmed, it is half the difference of their medians, so that the pair to be trimmed does
    not first shift every other pair of its order. The factor n(1/n_feat_first +
    1/n_base_first)/4 is the crossover's: 1 with as many pairs in each order, 9/8 with three.
    """
    first, second = signs > 0, signs < 0
    centre = np.median if robust else np.mean
    half_bias = (centre(d[:, first], axis=1) - centre(d[:, second], axis=1)) / 2
    n = len(signs)
    factor = n * (1 / first.sum() + 1 / second.sum()) / 4
    return d - half_bias[:, None] * signs, float(factor)


def _trimmed_and_winsorized(a: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """The g-per-side trimmed mean and the winsorized sum of squares about its own mean.

    scipy's trim_mean and mstats.winsorize agree with these (tests/test_verdict.py); the
    masked-array winsorize costs 25 ms on 1,000 comparisons, this one sort 0.3 ms.
    """
    n = a.shape[1]
    ordered = np.sort(a, axis=1)
    trimmed_mean = ordered[:, g : n - g].mean(axis=1)
    winsorized = np.clip(ordered, ordered[:, [g]], ordered[:, [n - g - 1]])
    ss = ((winsorized - winsorized.mean(axis=1, keepdims=True)) ** 2).sum(axis=1)
    return trimmed_mean, ss


def far_pair(d: np.ndarray, feat_first: np.ndarray) -> int | None:
    """The pair lying far from the others, if one does: a hint for the reason, not a decision.

    Far: its log-ratio's distance from its order's median is more than FAR times the others'
    median distance. Below TRIM_FROM such a pair widens the interval; the user is told which.
    """
    if len(d) < 3:
        return None
    order = np.asarray(feat_first, dtype=bool)
    groups = [order, ~order] if order.any() and (~order).any() else [np.ones_like(order)]
    distance = np.zeros(len(d))
    for members in groups:
        distance[members] = np.abs(d[members] - np.median(d[members]))
    i = int(distance.argmax())
    others = np.median(np.delete(distance, i))
    return i if distance[i] > FAR * others else None


# A pair is called far when it is this many times further from its order's median than the
# others' median distance (about 5.4 standard deviations of normal noise).
FAR = 8.0
