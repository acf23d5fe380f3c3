"""The verdict's error rates and cost on simulated sweeps: the tables of docs/verdict.md.

    python bench/verdict_table.py            # print the tables (markdown)
    python bench/verdict_table.py --write    # and replace the generated part of docs/verdict.md

Every figure comes from moe_perf.stats.simulate with a fixed seed: the same commit gives the
same tables on any machine (the run takes about a minute on two loaded cores).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
import subprocess
import sys
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np
import scipy
from scipy import stats

from moe_perf.stats import interval, verdict
from moe_perf.stats.interval import LogRatioFit, fit
from moe_perf.stats.simulate import SIGMAS, Case, nuisances, simulate
from moe_perf.stats.verdict import DIFFERENT, SAME, UNKNOWN, Plan, look

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "verdict.md"
BEGIN, END = "<!-- verdict_table.py: begin -->", "<!-- verdict_table.py: end -->"
MULTIPLES = (0, 0.5, 1, 2, 4)  # true change, in effects
SWEEPS = 10_000
FEWER = 4_000  # for the tables that compare choices
ONE_LOOK = 40_000  # for the per-look table: its rates are small


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


# --- the default plan ------------------------------------------------------------------------


def words_table(plan: Plan, nuisance: str) -> str:
    rows = []
    for name, sigma in SIGMAS.items():
        for k in MULTIPLES:
            fields = nuisances(sigma)[nuisance]
            o = simulate(Case(sigma, k * plan.effect, **fields), plan, SWEEPS, seed=11)
            change = f"{k:g}x ({k * plan.effect:+.1%})"
            rates = [pct(o.rate(w)) for w in (SAME, DIFFERENT, UNKNOWN)]
            rows.append([f"{name}, {sigma:.1%}", change, *rates, f"{o.mean_pairs:.1f}"])
    header = ["per-run spread", "true change", "SAME", "DIFFERENT", "UNKNOWN", "mean pairs"]
    return table(header, rows)


def false_alarm_table(plan: Plan) -> str:
    names = list(nuisances(0.01))
    rows = []
    for name, sigma in SIGMAS.items():
        cells = []
        for nuisance in names:
            fields = nuisances(sigma)[nuisance]
            cells.append(
                pct(simulate(Case(sigma, 0, **fields), plan, SWEEPS, seed=12).rate(DIFFERENT))
            )
        rows.append([f"{name}, {sigma:.1%}", *cells])
    return table(["per-run spread", *names], rows)


def twice_the_effect_table(plan: Plan) -> str:
    names = list(nuisances(0.01))
    rows = []
    for name, sigma in SIGMAS.items():
        cells = []
        for nuisance in names:
            same = 0
            for sign in (+1, -1):
                case = Case(sigma, sign * 2 * plan.effect, **nuisances(sigma)[nuisance])
                same += simulate(case, plan, SWEEPS, seed=17).count(SAME)
            cells.append(f"{same}")
        rows.append([f"{name}, {sigma:.1%}", *cells])
    return table(["per-run spread", *names], rows)


# --- choosing max_pairs ----------------------------------------------------------------------

MAX_PAIRS = (4, 6, 8, 10, 12, 16, 20)


def max_pairs_table(effect: float) -> str:
    ref, titan, mlm = SIGMAS.values()
    columns = [  # (header, case, word)
        ("reference A/A: SAME", Case(ref, 0), SAME),
        ("reference 1x: DIFFERENT", Case(ref, effect), DIFFERENT),
        ("reference 0.5x: DIFFERENT", Case(ref, effect / 2), DIFFERENT),
        ("torchtitan 2x: DIFFERENT", Case(titan, 2 * effect), DIFFERENT),
        ("torchtitan 4x: DIFFERENT", Case(titan, 4 * effect), DIFFERENT),
        ("Megatron-LM A/A: pairs", Case(mlm, 0), None),
    ]
    rows = []
    for m in MAX_PAIRS:
        plan = Plan(effect=effect, max_pairs=m)
        cells = []
        for _, case, word in columns:
            o = simulate(case, plan, FEWER, seed=13)
            cells.append(
                f"{o.mean_pairs:.1f}"
                if word is None
                else f"{pct(o.rate(word))} in {o.mean_pairs:.1f}"
            )
        alarms = [
            simulate(Case(s, 0), plan, FEWER, seed=14).rate(DIFFERENT) for s in SIGMAS.values()
        ]
        rows.append([str(m), *cells, pct(max(alarms))])
    header = ["max_pairs", *[c[0] for c in columns], "A/A DIFFERENT, worst spread"]
    return table(header, rows)


# --- the per-look error of fixed repeats ----------------------------------------------------


def yuen_df(d: np.ndarray, feat_first: np.ndarray) -> LogRatioFit:
    """moe_perf's fit with Yuen's own degrees of freedom (kept pairs less parameters)."""
    got = fit(d, feat_first)
    parameters = 2 if got.order_modelled else 1
    return replace(got, df=d.shape[1] - 2 * got.trimmed - parameters)


def yuen_20(d: np.ndarray, feat_first: np.ndarray) -> LogRatioFit:
    """20%-trimmed mean, Yuen's interval, order not modelled: scipy's trim_mean and winsorize."""
    n = d.shape[1]
    g = int(0.2 * n)
    h = n - 2 * g
    estimate = stats.trim_mean(d, 0.2, axis=1)
    if h < 2:
        return LogRatioFit(estimate, np.full(len(d), np.inf), 0, g, False)
    winsorized = np.asarray(stats.mstats.winsorize(d, limits=(0.2, 0.2), axis=1))
    se = np.sqrt((n - 1) * winsorized.var(axis=1, ddof=1) / (h * (h - 1)))
    return LogRatioFit(estimate, se, h - 1, g, False)


def paired_t(d: np.ndarray, feat_first: np.ndarray) -> LogRatioFit:
    """The paired t-interval of log-ratios: order not modelled, nothing trimmed."""
    with setting(interval, "TRIM_FROM", 10**9):
        return fit(d, np.zeros_like(feat_first))


PER_LOOK = (2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 20)


def per_look_table() -> str:
    fitters = {"moe_perf": fit, "Yuen's df": yuen_df, "Yuen 20%, no order": yuen_20}
    rows = []
    for name, fitter in fitters.items():
        for confidence in (0.95, 0.995):
            cells = []
            for n in PER_LOOK:
                plan = Plan(confidence=confidence, max_pairs=n, sequential=False)
                o = simulate(
                    Case(0.01, 0), plan, 4 * FEWER, seed=n, rule=partial(look, fitter=fitter)
                )
                cells.append(f"{o.rate(DIFFERENT) / plan.alpha:.2f}")
            rows.append([name, f"{confidence:.1%}", *cells])
    return table(["interval", "confidence", *[str(n) for n in PER_LOOK]], rows)


# --- the design choices ----------------------------------------------------------------------


@contextlib.contextmanager
def setting(module, name: str, value):
    """A module constant set for the length of a block: a what-if for this page only."""
    kept = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, kept)


def choice_row(label: str, plan: Plan, fitter=fit) -> list[str]:
    ref, titan, _ = SIGMAS.values()
    rule = partial(look, fitter=fitter)
    e = plan.effect
    cases = [
        (Case(ref, 0), SAME),
        (Case(ref, 0, second_arm_bias=0.03), SAME),
        (Case(ref, 0, **nuisances(ref)["outliers"]), SAME),
        (Case(ref, e, **nuisances(ref)["outliers"]), DIFFERENT),
        (Case(titan, 4 * e), DIFFERENT),
        (Case(ref, 4 * e), DIFFERENT),
    ]
    cells = []
    for case, word in cases:
        o = simulate(case, plan, FEWER, seed=15, rule=rule)
        cells.append(f"{pct(o.rate(word))} in {o.mean_pairs:.1f}")
    alarms = [
        simulate(Case(s, 0, **fields), plan, FEWER, seed=16, rule=rule).rate(DIFFERENT)
        for s in SIGMAS.values()
        for fields in nuisances(s).values()
    ]
    return [label, *cells, pct(max(alarms))]


@dataclass(frozen=True)
class LookingWithoutSpending(Plan):
    """Every look at the full error rate: what stopping at the first DIFFERENT would do."""

    def alpha_at(self, pairs):
        spent = np.where(np.asarray(pairs) >= self.first_look, self.alpha, 0.0)
        return float(spent) if spent.ndim == 0 else spent


def choices_table(plan: Plan) -> str:
    rows = [choice_row("moe_perf", plan)]
    naive = LookingWithoutSpending(plan.effect, plan.confidence, plan.max_pairs)
    rows.append(choice_row("every look at the full rate", naive))
    for first in (2, 3, 5):
        with setting(verdict, "FIRST_LOOK", first):
            rows.append(choice_row(f"first look at {first} pairs", plan))
    for trim_from in (5, 6, 8, 10**9):
        label = "never trim" if trim_from > 100 else f"trim from {trim_from} pairs"
        with setting(interval, "TRIM_FROM", trim_from):
            rows.append(choice_row(label, plan))
    rows.append(choice_row("paired t, order not modelled", plan, paired_t))
    rows.append(choice_row("Yuen 20%, order not modelled", plan, yuen_20))
    header = [
        "rule",
        "reference A/A: SAME",
        "+3% second-arm bias: SAME",
        "+outliers: SAME",
        "1x with outliers: DIFFERENT",
        "torchtitan 4x: DIFFERENT",
        "reference 4x: DIFFERENT",
        "A/A DIFFERENT, worst case",
    ]
    return table(header, rows)


# --- the page --------------------------------------------------------------------------------


def provenance() -> str:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return (
        f"Generated by `python bench/verdict_table.py --write` at commit {commit or '?'} on "
        f"{datetime.date.today()}: Python {platform.python_version()}, numpy {np.__version__}, "
        f"scipy {scipy.__version__}, {platform.machine()}. Seeded: the figures depend on the "
        "code, not on the machine."
    )


def two_se(alpha: float) -> str:
    """Two Monte-Carlo standard errors of a rate/nominal ratio measured over ONE_LOOK sweeps."""
    return f"+/-{2 * ((1 - alpha) / (alpha * ONE_LOOK)) ** 0.5:.2f}"


def page(plan: Plan) -> str:
    bound = plan.alpha + 3 * (plan.alpha * (1 - plan.alpha) / SWEEPS) ** 0.5
    sections = [
        provenance(),
        f"### The default plan: effect {plan.effect:.0%}, confidence {plan.confidence:.0%}, "
        f"max_pairs {plan.max_pairs}, no nuisance ({SWEEPS:,} sweeps a row)",
        words_table(plan, "none"),
        f"### The same, with every nuisance at once ({SWEEPS:,} sweeps a row)",
        words_table(plan, "all at once"),
        f"### A/A: how often DIFFERENT, per nuisance (bound {pct(bound)} at {SWEEPS:,} sweeps)",
        false_alarm_table(plan),
        f"### Twice the effect (+2% and -2%): SAME in how many of {2 * SWEEPS:,} sweeps",
        twice_the_effect_table(plan),
        f"### Choosing max_pairs ({FEWER:,} sweeps a cell; rate in mean pairs)",
        max_pairs_table(plan.effect),
        f"### Per-look error: fixed repeats, A/A DIFFERENT rate / nominal ({ONE_LOOK:,} sweeps; "
        f"two standard errors: {two_se(0.05)} at 95%, {two_se(0.005)} at 99.5%)",
        per_look_table(),
        f"### The design choices, each changed alone ({FEWER:,} sweeps a cell)",
        choices_table(plan),
    ]
    return "\n\n".join(sections) + "\n"


def write(generated: str) -> None:
    text = PAGE.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    PAGE.write_text(f"{head}{BEGIN}\n{generated}{END}{tail}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"replace the tables in {PAGE}")
    args = parser.parse_args()
    generated = page(Plan())
    print(generated)
    if args.write:
        write(generated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
