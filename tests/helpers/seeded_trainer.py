"""A contract trainer whose runs sit at seeded offsets: the verdict's real sweeps, reproducibly.

Each run prints the same step time for every step, `LEVEL_S * (1 + effect) * exp(offset)`,
where `offset ~ N(0, SIGMA)` is drawn from a generator seeded by (training.seed, arm, repeat),
so a test can compute every run median in-process (`run_median`) and check that a real sweep
reaches the words the decision rule gives those medians. A test repository's feat branch
commits its own `knobs.json` beside this file: `effects` (the relative step-time change of
that branch per sequence length, so two cells of one sweep can differ), `sigmas` (the
run-to-run spread per sequence length) and `sleep_s` (wall time per step, for the time
limit). Run as `python -m mytrainer <config.yaml>` by the runner.
"""

import json
import math
import os
import sys
import time
from pathlib import Path

import numpy
import yaml

SIGMA = 0.003  # the run-to-run offset: 0.3% of the step, the reference trainer's A/A spread
LEVEL_S = 0.1
ARMS = ("base", "feat")


def knobs() -> dict:
    path = Path(__file__).with_name("knobs.json")
    found = json.loads(path.read_text()) if path.exists() else {}
    return {"effects": {int(k): v for k, v in found.get("effects", {}).items()},
            "sigmas": {int(k): v for k, v in found.get("sigmas", {}).items()},
            "sleep_s": float(found.get("sleep_s", 0.0))}  # fmt: skip


def run_median(seed: int, arm: str, repeat: int, effect: float, sigma: float = SIGMA) -> float:
    """The step time (every step's, so the run's median) of one run, as printed."""
    rng = numpy.random.default_rng([int(seed), ARMS.index(arm), int(repeat)])
    value = LEVEL_S * (1 + effect) * math.exp(rng.normal(0.0, sigma))
    return float(f"{value:.6g}")  # the contract line's precision


def main() -> None:
    from moe_perf.common.contract import format_env, format_step

    cfg = yaml.safe_load(open(sys.argv[1]))
    world, knob = int(os.environ.get("WORLD_SIZE", "1")), knobs()
    cell = int(cfg["training"]["sequence_length"])
    effect, sigma = knob["effects"].get(cell, 0.0), knob["sigmas"].get(cell, SIGMA)
    seconds = run_median(cfg["training"]["seed"], cfg["arm"]["name"], cfg["repeat"], effect, sigma)
    steps = cfg["training"]["max_steps"]
    tokens = cfg["training"]["global_batch"] * cfg["training"]["sequence_length"]
    if int(os.environ.get("RANK", "0")) != 0:
        return
    print(format_env({"torch": None, "cuda": None, "nccl": None, "devices": [],
                      "world_size": world}), flush=True)  # fmt: skip
    for step in range(1, steps + 1):
        time.sleep(knob["sleep_s"])
        print(format_step(step, steps, step_time_s=seconds, tokens_per_s=tokens / seconds,
                          peak_mem_gib=0.5, loss=1.0), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
