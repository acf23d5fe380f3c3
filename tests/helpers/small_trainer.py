"""A small trainer for tests: real work per step (numpy), contract lines from rank 0.

Run as `python -m mytrainer <config.yaml>` by the runner. A test repository chooses how a branch
behaves by committing `knobs.json` beside this file (helpers.repos.trainer_files): `sleep_s`
(extra wall time per step, so a feature branch is measurably slower) and `exit_after_step`
(the step after which it exits 3, for a crashing arm). Without the file: no sleep, no crash.
numpy, not torch: what the tests check is the runner around the trainer, and a torch import is
about 2 s of each rank's start-up on a 2-core machine (torchrun itself still imports torch).
"""

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy
import yaml

from moe_perf.common.contract import format_env, format_step
from moe_perf.common.peak_rss import peak_rss_gib

MATMULS_PER_STEP = 30


def knobs() -> dict:
    path = Path(__file__).with_name("knobs.json")
    found = json.loads(path.read_text()) if path.exists() else {}
    return {"sleep_s": float(found.get("sleep_s", 0.0)),
            "exit_after_step": found.get("exit_after_step")}  # fmt: skip


def switch_user_branch(cfg: dict) -> None:
    """Tests of "the user switches branch mid-sweep" move the user's checkout from an arm."""
    branch = os.environ.get("TEST_SWITCH_USER_BRANCH_TO")
    if branch and os.environ.get("RANK", "0") == "0":
        subprocess.run(["git", "-C", cfg["repo"], "checkout", "-q", branch], check=True)


def print_env() -> None:
    env = {"torch": importlib.metadata.version("torch"), "cuda": None, "nccl": None,
           "devices": [], "world_size": int(os.environ.get("WORLD_SIZE", "1"))}  # fmt: skip
    print(format_env(env), flush=True)


def main() -> None:
    cfg, knob = yaml.safe_load(open(sys.argv[1])), knobs()
    switch_user_branch(cfg)
    steps = cfg["training"]["max_steps"]
    tokens = cfg["training"]["global_batch"] * cfg["training"]["sequence_length"]
    rank = int(os.environ.get("RANK", "0"))
    x = numpy.random.default_rng(cfg["training"]["seed"]).standard_normal((96, 96))
    if rank == 0:
        print_env()
    for step in range(1, steps + 1):
        start = time.perf_counter()
        for _ in range(MATMULS_PER_STEP):
            x = numpy.tanh(x @ x)
        time.sleep(knob["sleep_s"])
        seconds = time.perf_counter() - start
        peak_gib = peak_rss_gib()  # its own, not the runner's (ru_maxrss would be)
        if rank == 0:
            print(format_step(step, steps, step_time_s=seconds, tokens_per_s=tokens / seconds,
                              peak_mem_gib=peak_gib, loss=float(x.mean())), flush=True)  # fmt: skip
        if step == knob["exit_after_step"]:
            print("crashing on purpose", file=sys.stderr, flush=True)
            sys.exit(3)
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
