"""The verdict's words and its value object, and the one sentence a pull request shows.

`stats/verdict.py` decides; this module says what was decided: SAME, DIFFERENT or UNKNOWN, the
interval, the pairs, against the stated effect.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

SAME, DIFFERENT, UNKNOWN = "SAME", "DIFFERENT", "UNKNOWN"


@dataclass(frozen=True)
class Verdict:
    """One decision for feat against base, with its interval, in plain words."""

    word: str  # SAME | DIFFERENT | UNKNOWN
    estimate: float | None  # relative difference feat vs base (+0.021: feat's value 2.1% higher)
    low: float | None  # the confidence interval of `estimate` (relative); None: no spread
    high: float | None
    confidence: float  # of the interval, over the whole sweep (peak memory: 1.0, no interval)
    effect: float  # compare.effect (peak memory: compare.memory_tolerance)
    pairs: int
    beyond_effect: bool | None  # DIFFERENT only: does the whole interval lie beyond +/-effect?
    reason: str  # why this word; for UNKNOWN why, and what would decide it
    more_pairs: int | None  # UNKNOWN: about how many more pairs would decide it
    trimmed: int  # pairs trimmed on each side, the most extreme (0 below interval.TRIM_FROM)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Verdict:
        return cls(**{f.name: d[f.name] for f in fields(cls)})


# --------------------------------------------------------------------------------------------
# One sentence for a pull request


def describe(verdict: Verdict, more: str, less: str) -> str:
    """One sentence: '2.1% slower (95% CI 1.6 to 2.6%, 4 pairs): DIFFERENT, beyond the 1% effect'.

    `more`/`less`: the metric's words for a positive/negative estimate ("slower"/"faster" for
    step time). A DIFFERENT interval lies on one side of zero, so it reads as magnitudes.
    """
    v, effect = verdict, setting(verdict.effect)
    digits = _digits(v)
    if v.word == DIFFERENT:
        inside = _where(v)
        if v.low is not None:  # peak memory's verdict has none
            lo, hi = sorted([abs(v.low), abs(v.high)])
            span = f"{pct(lo, digits, unit=False)} to {pct(hi, digits)}"
            inside = f"{_ci(v)} {span}, {inside}"
        return (
            f"{pct(abs(v.estimate), digits)} {more if v.estimate > 0 else less} ({inside}): "
            f"DIFFERENT, {_against_effect(v)} the {effect} effect"
        )
    inside = _where(v)
    if v.low is not None:
        span = f"{signed(v.low, digits, unit=False)} to {signed(v.high, digits)}"
        inside = f"{_ci(v)} {span}, {inside}"
    if v.word == SAME:
        return f"no change beyond {effect} ({inside}): SAME"
    return f"UNKNOWN: {signed(v.estimate, digits)} ({inside}): {v.reason}"


def _digits(v: Verdict) -> int:
    """Two decimals when every figure is under 1% (a 0.3% spread), else one."""
    figures = [abs(x) for x in (v.estimate, v.low, v.high) if x is not None]
    return 1 if max(figures, default=0) >= 0.01 else 2


def _where(v: Verdict) -> str:
    pairs = f"{v.pairs} pair{'s' if v.pairs != 1 else ''}"
    return pairs + (f", {v.trimmed} trimmed each side" if v.trimmed else "")


def _against_effect(v: Verdict) -> str:
    if v.beyond_effect or v.low is None:
        return "beyond"
    if max(abs(v.low), abs(v.high)) <= v.effect:
        return "within"
    return "reaching"


def _ci(v: Verdict) -> str:
    return f"{setting(v.confidence)} CI"


def setting(x: float) -> str:
    """A stated setting as written: 0.01 -> '1%', 0.005 -> '0.5%', 0.999 -> '99.9%'."""
    return f"{x * 100:.10g}%"


def pct(x: float, digits: int = 1, unit: bool = True) -> str:
    return f"{x * 100:.{digits}f}" + ("%" if unit else "")


def signed(x: float, digits: int = 1, unit: bool = True) -> str:
    return ("+" if x > 0 else "") + pct(x, digits, unit)
