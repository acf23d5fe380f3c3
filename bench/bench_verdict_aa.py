"""Repeated real A/A sweeps of the reference trainer with pairs until decided: how often each word.

    python bench/bench_verdict_aa.py --sweeps 20 --out aa.json [--set key=value ...]

Each sweep is the real command, `python -m moe_perf refs.base=main refs.feat=main ... -m
arm=base,feat`, in a throwaway git repository that does not hold the trainer (so both arms run
the installed reference trainer: an A/A by construction), by default the tiny model on CPU at
sequence 64, global batch 4, 8 steps. The default plan (effect 1%, confidence 95%, at most 10
pairs) should call an A/A DIFFERENT in at most 5% of sweeps; the simulation's table
(docs/verdict.md) says how often at each run-to-run spread. Prints one line per sweep and the
counts; --out writes every sweep's verdict as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

SMALL = ["training.sequence_length=64", "training.global_batch=4", "training.max_steps=8",
         "wandb.mode=disabled"]  # fmt: skip
GIT_ENV = {f"GIT_{who}_{what}": value for who in ("AUTHOR", "COMMITTER")
           for what, value in (("NAME", "bench"), ("EMAIL", "bench@moe-perf.invalid"))}  # fmt: skip


def make_repo(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "README.md").write_text("an A/A repository\n")
    env = {**os.environ, **GIT_ENV}
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "init"]):
        subprocess.run(["git", "-C", str(path), *args], check=True, env=env)
    return path


def one_sweep(repo: Path, index: int, overrides: list[str]) -> dict:
    sweep_dir = repo / "outputs" / f"aa{index:03d}"
    command = [sys.executable, "-m", "moe_perf", *SMALL, *overrides, "refs.base=main",
               "refs.feat=main", f"hydra.sweep.dir={sweep_dir}", "-m", "arm=base,feat"]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run(command, cwd=repo, capture_output=True, text=True, check=False)
    wall = time.monotonic() - start
    try:
        (group,) = json.loads((sweep_dir / "comparison.json").read_text())["groups"]
        verdict = group["verdict"]["step_time_s"]
    except (OSError, ValueError, KeyError, TypeError):
        return {"sweep": index, "word": None, "exit_code": proc.returncode, "wall_s": wall,
                "error": proc.stderr[-500:]}  # fmt: skip
    return {"sweep": index, "word": verdict["word"], "estimate": verdict["estimate"],
            "low": verdict["low"], "high": verdict["high"], "pairs": verdict["pairs"],
            "wall_s": wall}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweeps", type=int, default=20)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for every sweep, e.g. compare.max_pairs=6")  # fmt: skip
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = make_repo(Path(tmp) / "repo")
        for index in range(args.sweeps):
            found = one_sweep(repo, index, args.set)
            results.append(found)
            print(json.dumps(found), flush=True)
    words = Counter(r["word"] for r in results)
    summary = {"sweeps": len(results), "words": dict(words), "overrides": SMALL + args.set,
               "different_rate": words["DIFFERENT"] / max(len(results), 1)}  # fmt: skip
    print(json.dumps(summary), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "sweeps": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
