"""The steady-state rule (moe_perf/stats/steady.py) on simulated runs: how often it drops steps
after step 1 and how often it calls a run unsettled, on flat, warming-up and trending runs.

    python bench/steady_simulation.py [--runs 2000] [--seed 0]

prints the Markdown table of docs/design.md "Steady state"; tests/test_steady.py runs the same
cases and asserts their rates. A simulated run is its measured steps (step 1 already left out):
step times of 1.0 times the case's warm-up factors, a linear drift, stragglers, and normal
noise of the case's relative sigma. The noise levels are those of real runs: 0.3% for the
reference trainer on an H100 (tests/data/h100_reference_*.log), 1% for torchtitan's steady
steps (0.84-0.85 s), 7.5% for Megatron-LM with local layers on an H200 (quartiles about 10% of
the median, host-bound) and CPU runs.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_perf.stats.steady import settle  # noqa: E402

STEPS = (8, 20, 40)  # whole runs, step 1 included: the default training.max_steps, longer runs
STRAGGLER_SLOWDOWN = 1.3  # a straggler step is 30% slower


@dataclass(frozen=True)
class Case:
    name: str
    noise: float  # relative sigma of every step
    warm: tuple[float, ...] = ()  # factors of the first measured steps: 1.46 is 46% slower
    drift: float = 0.0  # relative change from the first measured step to the last, linear
    stragglers: float = 0.0  # the chance of each step being a straggler


STEADY = (
    Case("flat, 0.3% noise (reference trainer, H100)", 0.003),
    Case("flat, 1% noise (torchtitan's steady steps)", 0.01),
    Case("flat, 7.5% noise (Megatron-LM local layers, CPU)", 0.075),
    Case("flat, 1% noise, 5% stragglers (+30%)", 0.01, stragglers=0.05),
    Case("drift within the band (+3%), 0.3% noise", 0.003, drift=0.03),
)
WARM = (
    Case("torchtitan's step 2 (+46%), 1% noise", 0.01, warm=(1.46,)),
    Case("two warm steps (+50%, +20%), 1% noise", 0.01, warm=(1.5, 1.2)),
    Case("Megatron's averaged step 2 (x2.8), 7.5% noise", 0.075, warm=(2.8,)),
)
# A straggler disturbs two step-to-step differences, so in a short run it widens the band
WARM_WITH_STRAGGLERS = (
    Case("torchtitan's step 2 (+46%), 1% noise, 5% stragglers", 0.01, warm=(1.46,),
         stragglers=0.05),
)  # fmt: skip
UNSETTLED = (
    Case("trend throughout (-30%), 0.3% noise", 0.003, drift=-0.3),
    Case("trend throughout (+20%), 1% noise", 0.01, drift=0.2),
    Case("slow drift (+8%), 0.3% noise", 0.003, drift=0.08),
)
CASES = STEADY + WARM + WARM_WITH_STRAGGLERS + UNSETTLED


@dataclass(frozen=True)
class Rates:
    """What the rule did over many simulated runs of one case and length."""

    runs: int
    dropped_any: float  # runs with at least one step dropped after step 1
    warm_dropped: float  # runs whose warm steps were all dropped (1.0 for a case without any)
    dropped_mean: float  # steps dropped after step 1, on average
    unsettled: float  # runs called unsettled
    fewest_kept: int  # the fewest steps any run kept


def simulate_run(case: Case, steps: int, rng: np.random.Generator) -> np.ndarray:
    """The measured step times (steps 2..steps) of one simulated run, in seconds."""
    n = steps - 1
    times = 1.0 + case.drift * np.linspace(0.0, 1.0, n)
    times[: len(case.warm)] *= case.warm
    times *= np.where(rng.random(n) < case.stragglers, STRAGGLER_SLOWDOWN, 1.0)
    return times * (1.0 + case.noise * rng.standard_normal(n))


def rates(case: Case, steps: int, runs: int = 2000, seed: int = 0) -> Rates:
    rng = np.random.default_rng(seed)
    found = [settle(range(2, steps + 1), simulate_run(case, steps, rng)) for _ in range(runs)]
    dropped = np.array([f.dropped for f in found])
    return Rates(
        runs=runs,
        dropped_any=float(np.mean(dropped > 0)),
        warm_dropped=float(np.mean(dropped >= len(case.warm))),
        dropped_mean=float(np.mean(dropped)),
        unsettled=float(np.mean([not f.settled for f in found])),
        fewest_kept=int(steps - 1 - dropped.max()),
    )


def table(runs: int, seed: int) -> str:
    lines = [
        "| case | steps | some step dropped | warm steps dropped | steps dropped (mean) "
        "| unsettled |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for case in CASES:
        for steps in STEPS:
            r = rates(case, steps, runs, seed)
            warm = f"{r.warm_dropped:.1%}" if case.warm else "-"
            lines.append(
                f"| {case.name} | {steps} | {r.dropped_any:.1%} | {warm} | {r.dropped_mean:.2f} "
                f"| {r.unsettled:.1%} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=2000, help="simulated runs per case and length")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(table(args.runs, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
