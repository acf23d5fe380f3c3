"""Steady state: which leading steps of a run are still settling, and whether it settles at all.

Step 1 (compilation, warm-up) is always dropped by the caller. This module judges the steps
after it: their step times x_1..x_m in step order, known values only. The rule:

1. Fewer than MIN_STEPS (5) steps: not judged. Nothing more is dropped, and the run counts as
   settled; the reason says so.
2. Level: c = the median of the later half, x_(floor(m/2)+1)..x_m.
3. Noise: sigma = 1.4826 x MAD(successive differences) / sqrt(2), the step-to-step noise. The
   differences ignore a level shift at the end of warm-up and a slow trend, which would widen a
   plain MAD of the values.
4. Band: c +- w, where w = max(BAND_SIGMAS x sigma, BAND_FLOOR x c) = max(4 sigma, 5% of c).
5. Settling: the leading steps outside the band, up to the first one inside it. At most
   floor(m/2) of them are dropped, so the later half, which sets the level, always stays.
6. Unsettled: the run is flagged, and its summary still uses the steps kept, when
   a. the step after the dropped ones is still outside the band (nothing in the first half
      came inside it), or
   b. the kept steps trend: their Theil-Sen drift (slope x (kept - 1)) is larger than w, and
      Kendall's tau of step time against step number gives p < TREND_P (0.01).

Why these constants (measured runs, docs/design.md "Steady state"):
* The 5% floor: GPU runs are flat to well under 1% from step to step (the reference trainer
  on an H100), so the floor sets their band. torchtitan's second step on an H100 is 1.24-1.37 s
  against a steady 0.84-0.85 s, +46% to +61%, far outside it. The floor is also 5 times the 1%
  change the comparison cares about, so it is not mistaken for a change.
* 4 sigma: noisy runs (Megatron-LM with local layers, host-bound on an H200: quartiles about
  10% of the median; CPU runs) are judged by their own noise. 3 sigma dropped step 2 of flat
  noisy runs in about 5% of simulated 8-step runs; 4 sigma drops it in about 3%, and most of
  those are stragglers that cannot be told apart from a slow warm-up step.
  Megatron-LM's step-2 line that averages steps 1-2 (2226 ms against about 800 ms) is outside
  any such band.
* TREND_P: Kendall's exact test cannot reach p < 0.01 on fewer than 6 steps, so a trend is
  only called on runs long enough to show one. Drift beyond the band is also required, so a
  significant but small drift (say 1% over 40 steps) is not called a trend.
The simulation in tests/test_steady.py measures the rates of dropping and of calling a run
unsettled on flat, warming-up and trending series, and asserts them.

Pure (stdlib; scipy.stats only to test a drift larger than the band).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

MIN_STEPS = 5
BAND_SIGMAS = 4.0
BAND_FLOOR = 0.05
TREND_P = 0.01
_MAD_TO_SIGMA = 1.4826  # a normal distribution's sigma is 1.4826 x its median absolute deviation


@dataclass(frozen=True)
class Settling:
    """Where a run's steady state starts, after step 1 was dropped."""

    first_steady_step: int | None  # the first step the summary uses; None: no step time at all
    dropped: int  # leading steps after step 1 dropped as still settling
    settled: bool  # False: the run never settled; `reason` says how
    reason: str  # why steps were dropped, why the run is unsettled, or why it was not judged
    level_s: float | None = None  # c: the median step time of the later half
    band_s: float | None = None  # w: how far from c a steady step may lie


def settle(steps: Sequence[int], times_s: Sequence[float]) -> Settling:
    """The steady state of a run from its measured steps (step 1 already left out) and their
    step times, in step order."""
    steps, times = list(steps), [float(t) for t in times_s]
    if len(steps) != len(times):
        raise ValueError(f"{len(steps)} steps but {len(times)} step times")
    if not times:
        return Settling(None, 0, True, "no step times to judge")
    if len(times) < MIN_STEPS:
        why = f"not judged: {len(times)} measured step(s), {MIN_STEPS} needed to tell settling"
        return Settling(steps[0], 0, True, why)
    level, band = _level(times), _band(times)
    dropped = _settling(times, level, band)
    found = Settling(steps[dropped], dropped, True, "", level, band)
    if abs(times[dropped] - level) > band:
        return _unsettled(found, _never_inside(steps, dropped, level, band))
    drift = _drift(times[dropped:])
    if abs(drift) > band and _trend_p(times[dropped:]) < TREND_P:
        return _unsettled(found, _trending(steps[dropped:], drift, level, band))
    if dropped:
        return _replace(found, reason=_dropped_words(steps, dropped, level, band))
    return found


def _level(times: list[float]) -> float:
    return statistics.median(times[len(times) // 2 :])


def _band(times: list[float]) -> float:
    diffs = [b - a for a, b in zip(times[:-1], times[1:], strict=True)]
    center = statistics.median(diffs)
    mad = statistics.median(abs(d - center) for d in diffs)
    sigma = _MAD_TO_SIGMA * mad / math.sqrt(2)  # a difference of two steps has sqrt(2) sigma
    return max(BAND_SIGMAS * sigma, BAND_FLOOR * _level(times))


def _settling(times: list[float], level: float, band: float) -> int:
    """How many leading steps lie outside the band, at most the first half."""
    limit, dropped = len(times) // 2, 0
    while dropped < limit and abs(times[dropped] - level) > band:
        dropped += 1
    return dropped


def _drift(times: list[float]) -> float:
    """Theil-Sen: the median slope over all pairs of steps, times the span of the steps (s)."""
    slopes = [
        (times[j] - times[i]) / (j - i) for i in range(len(times)) for j in range(i + 1, len(times))
    ]
    return statistics.median(slopes) * (len(times) - 1) if slopes else 0.0


def _trend_p(times: list[float]) -> float:
    # imported here: scipy.stats costs about a second to import, and only a run that drifts by
    # more than its band needs the test
    from scipy.stats import kendalltau

    p = kendalltau(range(len(times)), times).pvalue
    return 1.0 if math.isnan(p) else float(p)


# ---- the words -------------------------------------------------------------------------------


def _replace(found: Settling, **changes) -> Settling:
    return Settling(**{**found.__dict__, **changes})


def _unsettled(found: Settling, reason: str) -> Settling:
    return _replace(found, settled=False, reason=reason)


def _steps_words(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


def _band_words(level: float, band: float) -> str:
    return f"{level:.4g} s +- {band / level:.1%} (the band around the later half's median)"


def _dropped_words(steps: list[int], dropped: int, level: float, band: float) -> str:
    return (
        f"{_steps_words(steps[0], steps[dropped - 1])} still settling, outside "
        f"{_band_words(level, band)}: dropped"
    )


def _never_inside(steps: list[int], dropped: int, level: float, band: float) -> str:
    return (
        f"never settled: {_steps_words(steps[0], steps[dropped])} all outside "
        f"{_band_words(level, band)}; the first half was dropped and the rest is still changing"
    )


def _trending(steps: list[int], drift: float, level: float, band: float) -> str:
    return (
        f"never settled: step time drifts {drift / level:+.1%} from step {steps[0]} to step "
        f"{steps[-1]} (Theil-Sen slope, Kendall's tau p < {TREND_P:g}), more than its band of "
        f"+- {band / level:.1%}"
    )
