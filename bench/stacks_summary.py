"""Where the trainer's host time went, from its sampled stacks (trainer.sample_stacks_ms).

    python bench/stacks_summary.py ARM_DIR/profile/stacks_rank0.txt [--phase "since parallelized"]
        [--thread main] [--top 25] [--under moe_perf/trainer/train.py:train_step]

Per phase (the last start-up mark reached: step 1 is in "since parallelized"), the thread's
seconds (the main thread's by default, whose seconds are the wall time; `--thread "unnamed thread"`
for autograd's device thread, `--thread all`), then the functions with the most inclusive time (the
stack was in them: each counted once per stack) and the most self time (the innermost frame).
--under keeps only the stacks through a function, to split one call's time (e.g. step 1's
`train_step`) by what it called.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path


def read(path: Path, thread: str = "main") -> list[tuple[str, list[str], float]]:
    """(phase, frames outermost first, seconds) per line of a collapsed-stacks file, of one
    thread's stacks (its label left out) or, with thread "all", of every thread's."""
    rows = []
    for line in path.read_text().splitlines():
        stack, seconds = line.rsplit(" ", 1)
        phase, label, *frames = stack.split(";")
        if thread == "all":
            frames = [label, *frames]
        elif label != f"[{thread}]":
            continue
        rows.append((phase, frames, float(seconds)))
    return rows


def summarize(rows, under: str | None = None) -> dict[str, dict]:
    """Per phase: total seconds, inclusive and self seconds per function."""
    phases: dict[str, dict] = {}
    for phase, frames, seconds in rows:
        if under is not None:
            if under not in frames:
                continue
            frames = frames[frames.index(under) :]
        p = phases.setdefault(
            phase, {"seconds": 0.0, "inclusive": defaultdict(float), "self": defaultdict(float)}
        )
        p["seconds"] += seconds
        for name in set(frames):
            p["inclusive"][name] += seconds
        if frames:
            p["self"][frames[-1]] += seconds
    return phases


def show(phases: dict[str, dict], top: int) -> None:
    for phase, p in phases.items():
        print(f"== {phase}: {p['seconds']:.2f} s sampled")
        for kind in ("inclusive", "self"):
            print(f"  {kind} (s):")
            for name, s in sorted(p[kind].items(), key=lambda kv: -kv[1])[:top]:
                print(f"  {s:8.3f}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stacks", type=Path)
    parser.add_argument("--phase", action="append", help="only these phases (repeatable)")
    parser.add_argument("--thread", default="main", help="a thread's name, or all")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--under", help="only the stacks through this file:function")
    args = parser.parse_args()
    phases = summarize(read(args.stacks, args.thread), args.under)
    if args.phase:
        phases = {k: v for k, v in phases.items() if k in args.phase}
    show(phases, args.top)


if __name__ == "__main__":
    main()
