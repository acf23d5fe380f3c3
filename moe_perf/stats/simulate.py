"""Simulated sweeps: the verdict's error rates and cost, measured rather than assumed.

A sweep draws its run medians as
    level * exp(change * [feat] + offset + drift * run + bias * [second of its pair] + outlier)
with a per-run offset N(0, sigma), a slow drift over the run index (linear, or a random walk),
a second-arm bias on the second run of each pair (ABBA order: pair 0 base then feat, pair 1
feat then base, ...), and an occasional outlying (slow) run. Pairs are added exactly as the
sweeper adds them: verdict.look after each pair, verdict.undecided as the stopping rule
(keep_adding's elementwise form).
Vectorized over sweeps: a thousand sweeps of ten pairs take about 10 ms.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moe_perf.stats.interval import abba
from moe_perf.stats.verdict import DIFFERENT, SAME, UNKNOWN, Look, Plan, look, undecided

# A decision rule as the sweeper sees it: log-ratios (S, n), which pairs ran feat first, the
# plan -> the words. verdict.look is the one moe_perf uses; bench/verdict_table.py passes others
# to compare them on the same sweeps.
Rule = Callable[[np.ndarray, np.ndarray, Plan], Look]

WORDS = (SAME, DIFFERENT, UNKNOWN)


@dataclass(frozen=True)
class Case:
    """How the run medians of a simulated sweep scatter (all relative to the step, log scale)."""

    sigma: float  # per-run offset: the A/A spread of one run's median
    change: float = 0.0  # the true change, feat against base (0.02: feat 2% slower)
    drift_per_run: float = 0.0  # every run this much slower than the one before
    wander_per_run: float = 0.0  # a random walk: each run's level moves by N(0, this)
    second_arm_bias: float = 0.0  # the second run of a pair this much faster
    outlier_rate: float = 0.0  # chance that a run is outlying
    outlier_size: float = 0.0  # an outlying run this much slower
    level: float = 1.0  # the base's step time

    def describe(self) -> str:
        parts = [f"sigma {self.sigma:.1%}", f"change {self.change:+.2%}"]
        if self.drift_per_run:
            parts.append(f"drift {self.drift_per_run:.1%}/run")
        if self.wander_per_run:
            parts.append(f"random walk {self.wander_per_run:.1%}/run")
        if self.second_arm_bias:
            parts.append(f"second arm {self.second_arm_bias:.0%} faster")
        if self.outlier_rate:
            parts.append(f"{self.outlier_rate:.0%} runs {self.outlier_size:.0%} slow")
        return ", ".join(parts)


@dataclass(frozen=True)
class Outcome:
    """How often each word came out, and the pairs it took, over `sweeps` simulated sweeps."""

    case: Case
    plan: Plan
    sweeps: int
    rates: dict[str, float]  # word -> fraction of sweeps
    mean_pairs: float

    def rate(self, word: str) -> float:
        return self.rates[word]

    def count(self, word: str) -> int:
        return round(self.rates[word] * self.sweeps)


def run_medians(
    case: Case, pairs: int, sweeps: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(base, feat) run medians, each (sweeps, pairs), in the order the sweeper runs them."""
    runs = 2 * pairs
    offset = rng.normal(0.0, case.sigma, (sweeps, runs))
    offset += case.drift_per_run * np.arange(runs)
    offset += np.cumsum(rng.normal(0.0, case.wander_per_run, (sweeps, runs)), axis=1)
    offset += np.where(rng.random((sweeps, runs)) < case.outlier_rate, case.outlier_size, 0.0)
    offset -= case.second_arm_bias * (np.arange(runs) % 2 == 1)
    feat_first = abba(pairs)
    pair_start = 2 * np.arange(pairs)
    feat_run = pair_start + np.where(feat_first, 0, 1)
    base_run = pair_start + np.where(feat_first, 1, 0)
    log_base = offset[:, base_run]
    log_feat = offset[:, feat_run] + np.log1p(case.change)
    return case.level * np.exp(log_base), case.level * np.exp(log_feat)


def simulate(
    case: Case, plan: Plan, sweeps: int = 1000, seed: int = 0, rule: Rule = look
) -> Outcome:
    """Run `sweeps` sweeps of `case` under `plan`; the same seed gives the same outcome."""
    base, feat = run_medians(case, plan.max_pairs, sweeps, np.random.default_rng(seed))
    words, pairs_used = sweep(base, feat, plan, rule)
    rates = {w: float(np.mean(words == w)) for w in WORDS}
    return Outcome(case, plan, sweeps, rates, float(pairs_used.mean()))


def sweep(
    base: np.ndarray, feat: np.ndarray, plan: Plan, rule: Rule = look
) -> tuple[np.ndarray, np.ndarray]:
    """Each sweep's last word and pairs used: a pair added while verdict.undecided says so."""
    sweeps, pairs = base.shape
    d = np.log(feat) - np.log(base)
    feat_first = abba(pairs)
    words = np.full(sweeps, UNKNOWN, dtype=object)
    pairs_used = np.zeros(sweeps, dtype=int)
    going = np.ones(sweeps, dtype=bool)
    last = min(pairs, plan.max_pairs)
    # Fixed repeats run every pair whatever the interim words: only the last look counts.
    for n in range(1, last + 1) if plan.sequential else [last]:
        seen = rule(d[going, :n], feat_first[:n], plan)
        idx = np.flatnonzero(going)
        words[idx], pairs_used[idx] = seen.words, n
        going[idx] = undecided(seen.words, n, plan)
        if not going.any():
            break
    return words, pairs_used


# The measured A/A spreads of one run's median, relative to the step (the verdict's design
# cases): the reference trainer about 0.3%, torchtitan about 1.5%, Megatron-LM about 10%.
SIGMAS = {"reference trainer": 0.003, "torchtitan": 0.015, "Megatron-LM": 0.10}


def nuisances(sigma: float) -> dict[str, dict]:
    """The nuisances each design case is run with and without, as Case fields.

    Outliers: one run in 20 slow by 10 sigma (a run on a disturbed machine). Drift: 0.2% per
    run, 4.8% over 12 pairs. Random walk: half a sigma per run. Second-arm bias: 3%, the
    middle of the 2-6% that CPU A/As showed.
    """
    each = {
        "outliers": {"outlier_rate": 0.05, "outlier_size": 10 * sigma},
        "drift": {"drift_per_run": 0.002},
        "random walk": {"wander_per_run": sigma / 2},
        "second-arm bias": {"second_arm_bias": 0.03},
    }
    combined = {k: v for fields in each.values() for k, v in fields.items()}
    return {"none": {}, **each, "all at once": combined}
