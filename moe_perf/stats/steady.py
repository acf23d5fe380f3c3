"""Steady state: which leading steps of a run are still settling, and whether it settles at all.

Step 1 (compilation, warm-up) is always dropped by the caller. This module judges the steps
after it: their step times x_1..x_m in step order, known values only. The rule:

1. Fewer than MIN_STEPS (7) steps, a run of fewer than 8 steps: not judged. Nothing more is
   dropped and the run counts as settled; the reason says it was not judged.
2. Level: c = the median of the later half, x_(floor(m/2)+1)..x_m.
3. Noise: sigma = 1.4826 x MAD(successive differences) / sqrt(2), the step-to-step noise. The
   differences ignore a level shift at the end of warm-up and a slow trend, which would widen a
   plain MAD of the values.
4. Band: c +- w, where w = max(BAND_SIGMAS x sigma, BAND_FLOOR x c) = max(4 sigma, 5% of c).
5. Settling: the leading steps outside the band, up to the first one inside it. At most
   floor(m/2) of them are dropped, so the later half, which sets the level, always stays.
6. Unsettled: the run is flagged, and its summary still uses the steps kept, when
   a. the whole first half was dropped (rule 5's limit): a run that settles that late cannot
      be told from one still changing (of simulated 8-step runs drifting +20% throughout, 3 in
      4 came inside the band at step 5, and 4 steps are too few to test for a trend), or
   b. the kept steps y_1..y_n trend: their drift, the median of y_(i+h) - y_i over
      i = 1..n-h with h = floor(n/2) (disjoint pairs half the kept run apart), times
      (n - 1) / h, is larger than w, and Kendall's tau of step time against step number gives
      p < TREND_P (0.01).

Why these constants (the rates are of bench/steady_simulation.py, 2,000 runs a case; the real
runs are in docs/design.md "Steady state"):
* The 5% floor: GPU runs are flat to well under 1% from step to step (the reference trainer
  on an H100: every step within 2% of its median), so the floor sets their band and such a
  run drops nothing. torchtitan's second step on an H100 is 1.24-1.37 s against a steady
  0.84-0.85 s, +46% to +61%, far outside it. The floor is 5 times the 1% change a comparison
  looks for, so a change is never mistaken for settling.
* 4 sigma: noisy runs (Megatron-LM with local layers, host-bound on an H200, quartiles about
  10% of the median; CPU runs) are judged by their own noise. In flat 8-step runs with 7.5%
  noise, 3 sigma dropped some step in 8.0% of runs and called 1.0% unsettled; 4 sigma 4.2% and
  0.5%; 5 sigma 2.1% and 0.2%, but kept torchtitan's warm step among 7.5% noise in half the
  runs (4 sigma: a third). Megatron-LM's step-2 line that averages steps 1-2 (2226 ms against
  about 800 ms) is outside any such band.
* MIN_STEPS: with fewer steps the band rests on too few differences. Flat runs with 7.5% noise
  were called unsettled in 3.6% of 6-step runs and 1.4% of 7-step runs, 0.6% of 8-step runs.
* TREND_P: Kendall's exact test cannot reach p < 0.01 on fewer than 6 steps, so a trend is
  only called on runs long enough to show one. Drift beyond the band is also required, so a
  significant but small drift (3% over 40 steps) is not called a trend.
* Known limit, an error toward keeping steps: a straggler disturbs two differences, so in a
  short run it widens the band. torchtitan's warm step 2 among 5% stragglers (+30%) is dropped
  in 82% of 8-step runs and all 40-step runs.
tests/test_steady.py asserts these rates.

Pure (stdlib; scipy.stats only to test a drift larger than the band).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

MIN_STEPS = 7
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
    if not all(t > 0 and math.isfinite(t) for t in times):
        return Settling(steps[0], 0, True, "not judged: a step time is not a positive number")
    level, band = _level(times), _band(times)
    dropped = _settling(times, level, band)
    found = Settling(steps[dropped], dropped, True, "", level, band)
    if dropped == len(times) // 2:
        return _unsettled(found, _first_half(steps, dropped, level, band))
    drift = _drift(times[dropped:])
    if abs(drift) > band and _trend_p(times[dropped:]) < TREND_P:
        return _unsettled(found, _trending(steps[dropped:], drift, level, band))
    if dropped:
        return replace(found, reason=_dropped_words(steps, dropped, level, band))
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
    """The change over the steps (s): the median change between steps half the run apart,
    scaled to the whole span. Robust to a straggler like Theil-Sen's all-pairs slope, but the
    pairs are disjoint and O(n): a log of 10,000 iterations is read in milliseconds."""
    half = len(times) // 2
    if not half:
        return 0.0
    changes = [times[i + half] - times[i] for i in range(len(times) - half)]
    return statistics.median(changes) * (len(times) - 1) / half


def _trend_p(times: list[float]) -> float:
    # imported here: scipy.stats costs about a second to import, and only a run that drifts by
    # more than its band needs the test
    from scipy.stats import kendalltau

    p = kendalltau(range(len(times)), times).pvalue
    return 1.0 if math.isnan(p) else float(p)


# ---- the words -------------------------------------------------------------------------------


def _unsettled(found: Settling, reason: str) -> Settling:
    return replace(found, settled=False, reason=reason)


def _steps_words(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


def _band_words(level: float, band: float) -> str:
    return f"{level:.4g} s +- {band / level:.1%} (the band around the later half's median)"


def _dropped_words(steps: list[int], dropped: int, level: float, band: float) -> str:
    return (
        f"{_steps_words(steps[0], steps[dropped - 1])} still settling, outside "
        f"{_band_words(level, band)}: dropped"
    )


def _first_half(steps: list[int], dropped: int, level: float, band: float) -> str:
    return (
        f"never settled in the first half of the run: {_steps_words(steps[0], steps[dropped - 1])}"
        f" all outside {_band_words(level, band)}; the later half may still be changing (run "
        f"more steps)"
    )


def _trending(steps: list[int], drift: float, level: float, band: float) -> str:
    return (
        f"never settled: step time drifts {drift / level:+.1%} from step {steps[0]} to step "
        f"{steps[-1]} (Kendall's tau p < {TREND_P:g}), more than its band of "
        f"+- {band / level:.1%}"
    )
