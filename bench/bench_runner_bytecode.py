"""What the runner's own imports cost where Python may not write bytecode beside the sources.

    python bench/bench_runner_bytecode.py OUT_DIR [--runs 5] [--sweep SWEEP_DIR]

Under PYTHONDONTWRITEBYTECODE=1 (set by many container images, the CUDA image of the GPU
benchmarks among them, whose packages also come without bytecode) every `python -m moe_perf`
compiled every module it imported. Two of the runner's commands that launch no trainer, timed
in turn, RUNS times each:
- `dry run`: a dry run of a four-arm sweep in a scratch repository: the runner's imports (Hydra,
  numpy, moe_perf), the composition and the pre-flight of every job, what a sweep does before
  its first arm;
- `compare`: `python -m moe_perf.compare COPY` of a copy of SWEEP_DIR: the end-of-sweep
  comparison, which imports scipy and matplotlib and writes its plot.
Each in two conditions, alternated:
- `kept`: the runner as it is: its bytecode kept in the machine's moe_perf cache
  (OUT_DIR/xdg, filled by one command of each before the timed ones);
- `compiled`: every module compiled anew, as the runner did before it kept its bytecode: a new,
  empty PYTHONPYCACHEPREFIX of its own per command (a prefix the user names, which the runner
  leaves alone), so Python finds no bytecode anywhere, as on such an image.
SWEEP_DIR defaults to a sweep made first (the tiny model on CPU, one pair). Prints a table and
writes OUT_DIR/runner_bytecode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_startup import scratch_repo

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model=tiny", "training.device=cpu", "dtype=fp32", "training.sequence_length=64",
         "training.global_batch=2", "training.max_steps=3", "wandb.mode=disabled",
         "compare.max_pairs=1"]  # fmt: skip
CONDITIONS = ("kept", "compiled")


def command(argv: list[str], cwd: Path, env: dict[str, str]) -> float:
    """Seconds of wall of `python ARGV`; exits with its output when it fails."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, check=False)  # fmt: skip
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-2000:]}"
                 f"{done.stderr[-2000:]}")  # fmt: skip
    return wall


def environment(condition: str, out: Path, xdg: str = "xdg") -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "XDG_CACHE_HOME": str(out / xdg),
           "PYTHONPATH": path}  # fmt: skip
    env.pop("PYTHONPYCACHEPREFIX", None)
    if condition == "compiled":
        env["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="prefix-", dir=out / "empty")
    return env


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    return next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")),
                platform.machine())  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sweep", type=Path, help="a sweep directory to compare (default: one "
                        "made first)")  # fmt: skip
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "empty").mkdir(exist_ok=True)
    repo = scratch_repo()
    sweep = args.sweep
    if sweep is None:
        command(
            ["-m", "moe_perf", f"repo={repo}", *SMALL, "-m", "arm=base,feat"],
            repo,
            environment("kept", out, xdg="xdg-sweep"),
        )  # its own: OUT_DIR/xdg starts empty
        sweep = repo / "outputs" / "validate-performance"
    copy = out / "sweep"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(sweep, copy)
    commands = {
        "dry run": ["-m", "moe_perf", f"repo={repo}", *SMALL, "dry_run=true", "-m",
                    "arm=base,feat", "repeat=0,1"],
        "compare": ["-m", "moe_perf.compare", str(copy)],
    }  # fmt: skip
    first = {name: command(argv, repo, environment("kept", out)) for name, argv in
             commands.items()}  # fmt: skip
    walls: dict = {c: {name: [] for name in commands} for c in CONDITIONS}
    for _ in range(args.runs):
        for condition in CONDITIONS:
            for name, argv in commands.items():
                walls[condition][name].append(command(argv, repo, environment(condition, out)))
    shutil.rmtree(out / "empty", ignore_errors=True)
    shutil.rmtree(repo.parent, ignore_errors=True)

    print(f"{cpu_model()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; {args.runs} runs of each")  # fmt: skip
    print("| command | kept: median [min-max] | compiled: median [min-max] | kept's first |")
    print("| --- | ---: | ---: | ---: |")
    for name in commands:
        cells = []
        for condition in CONDITIONS:
            w = walls[condition][name]
            cells.append(f"{statistics.median(w):.2f} s [{min(w):.2f}-{max(w):.2f}]")
        print(f"| {name} | {cells[0]} | {cells[1]} | {first[name]:.2f} s |")
    (out / "runner_bytecode.json").write_text(json.dumps(
        {"runs": args.runs, "walls_s": walls, "kept_first_s": first,
         "python": platform.python_version(), "cpu": cpu_model(), "cores": os.cpu_count()},
        indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
