"""A contract trainer whose steps do real, fixed work: a planted slowdown is more work.

Each step runs `iterations` matmul-and-tanh rounds on a 128x128 matrix (numpy, one thread), so
its time is measured, not drawn, and a branch that raises `iterations` in its committed
`knobs.json` (beside this file) is slower by that much work; `exit_after_step` makes it crash
after that step (a commit that fails to run). The step time reported is
`iterations` times the fastest round's CPU time (`time.process_time`): on a test machine shared
with other processes, their load would otherwise enter the wall time of each run differently,
and on a core whose sibling hyperthread is busy for part of a step even CPU time stretches;
the fastest of 40-80 rounds of identical work is the round that was not interfered with. Run as
`python -m mytrainer <config.yaml>` by the runner.
"""

import json
import os
import sys
import time
from pathlib import Path

import numpy
import yaml


def knobs() -> dict:
    path = Path(__file__).with_name("knobs.json")
    return {"iterations": 40, "exit_after_step": None,
            **(json.loads(path.read_text()) if path.exists() else {})}  # fmt: skip


def main() -> None:
    from moe_perf.common.contract import format_step
    from moe_perf.common.peak_rss import peak_rss_bytes

    cfg = yaml.safe_load(open(sys.argv[1]))
    knob = knobs()
    steps, rounds = cfg["training"]["max_steps"], int(knob["iterations"])
    tokens = cfg["training"]["global_batch"] * cfg["training"]["sequence_length"]
    x = numpy.random.default_rng(cfg["training"]["seed"]).standard_normal((128, 128)) / 16
    for step in range(1, steps + 1):
        fastest = float("inf")
        for _ in range(rounds):
            start = time.process_time()
            x = numpy.tanh(x @ x)
            fastest = min(fastest, time.process_time() - start)
        seconds = rounds * fastest
        if int(os.environ.get("RANK", "0")) == 0:
            print(format_step(step, steps, step_time_s=seconds, tokens_per_s=tokens / seconds,
                              peak_mem_gib=peak_rss_bytes() / 2**30, loss=float(x.mean())),
                  flush=True)  # fmt: skip
        if step == knob["exit_after_step"]:
            sys.exit(f"crashing on purpose after step {step}")


if __name__ == "__main__":
    main()
