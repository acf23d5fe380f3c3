"""Time to answer: one arm of the bench config, run several times in a row through the real
command, the first with an empty compile cache, the rest warm.

    python bench/bench_startup.py OUT_DIR [--runs 3] [--set key=value ...]

Default shapes: 4-layer qwen3-30b-a3b, one device, seq 2048, global batch 32, micro-batch 16,
bf16, compiled, forced balance, 8 steps. Each run is `python -m moe_perf repo=<a scratch git
repository> arm=base ... compile_cache=OUT_DIR/cache`; the scratch repository holds no trainer,
so the installed (PYTHONPATH) moe_perf trainer runs. OUT_DIR/cache starts empty, so run 1 is
cold; runs 2.. load from it. Per run it prints the command's wall time, the arm's wall (runner
record), step 1, the start-up before step 1 and its parts (the trainer's startup.json marks:
seconds since its process started), the measured steps and their share of the command's wall,
and the compile-cache counters. Everything is written to OUT_DIR/startup.json as well.

`--set` replaces a default (`--set model=tiny --set dtype=bf16 --set training.sequence_length=64`
runs it on a CPU); `--env KEY=VALUE` adds to the environment of every run (and so of the
trainer), e.g. `--env TORCHINDUCTOR_COMPILE_THREADS=1` to see what inductor's compile-worker
pool, started by the first compile even when every graph then loads from the cache, costs.
`--cache DIR` keeps the compile cache elsewhere than OUT_DIR/cache, and `--warm` leaves it as
it is (run 1 is then warm too: several benches can share one cache, e.g. a variant measured
against the caches its baseline filled).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {
    "model": "qwen3-30b-a3b", "model.num_layers": "4", "mesh": "single", "dtype": "bf16",
    "training.sequence_length": "2048", "training.global_batch": "32",
    "training.micro_batch": "16", "training.max_steps": "8", "routing": "balanced",
    "trainer.compile": "true", "wandb.mode": "disabled", "timeout_s": "900",
}  # fmt: skip


def scratch_repo() -> Path:
    repo = Path(tempfile.mkdtemp(prefix="moe_perf-startup-")) / "repo"
    repo.mkdir()
    who = {"NAME": "bench", "EMAIL": "bench@moe-perf.invalid"}
    env = {**os.environ, **{f"GIT_{role}_{k}": v for role in ("AUTHOR", "COMMITTER")
                            for k, v in who.items()}}  # fmt: skip
    (repo / "README.md").write_text("scratch repository of bench/bench_startup.py\n")
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "scratch"]):
        subprocess.run(["git", "-C", str(repo), *args], check=True, env=env)
    return repo


def one_run(i: int, repo: Path, out: Path, cache: Path, overrides: dict[str, str],
            extra_env: dict, pairs: int = 0) -> dict | list[dict]:  # fmt: skip
    run_dir = out / f"run{i}"
    shutil.rmtree(run_dir, ignore_errors=True)
    arms = ["arm=base", f"hydra.run.dir={run_dir}"]
    if pairs:  # one sweep of `pairs` A/A pairs: base and feat are the same commit
        repeats = ",".join(map(str, range(pairs)))
        arms = [f"hydra.sweep.dir={run_dir}", "-m", "arm=base,feat", f"repeat={repeats}"]
    argv = [sys.executable, "-m", "moe_perf", f"repo={repo}",
            *(f"{k}={v}" for k, v in overrides.items()), f"compile_cache={cache}",
            *arms]  # fmt: skip
    env = {
        **os.environ,
        **extra_env,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, check=False)
    command_s = time.perf_counter() - t0
    (out / f"run{i}.log").write_text(proc.stdout + proc.stderr)
    paths = sorted(run_dir.rglob("metrics.json")) if pairs else [run_dir / "metrics.json"]
    if proc.returncode != 0 or not paths or not all(p.exists() for p in paths):
        raise SystemExit(f"run {i} failed (exit {proc.returncode}); see {out / f'run{i}.log'}")
    records = [json.loads(p.read_text()) for p in paths]
    for record in records:
        if record["status"] != "ok":
            raise SystemExit(f"run {i}: {record['failure']}; see {record['log']}")
    if not pairs:
        return summarize(records[0], command_s)
    records.sort(key=lambda r: r["started"])  # the order the sweep ran them
    return [summarize(r, command_s) | {"arm": r["arm_dir"].rsplit("-", 2)[-2:]} for r in records]


def summarize(record: dict, command_s: float) -> dict:
    times = [s["step_time_s"] for s in record["steps"]]
    marks = record.get("startup_marks_s") or {}
    step1_start = marks.get("step1_done", 0.0) - times[0]  # process age when step 1 began
    trainer_wall = record["trainer_wall_s"]
    return {
        "command_wall_s": round(command_s, 2),
        "arm_wall_s": record["wall_time_s"],
        "trainer_wall_s": trainer_wall,
        "step1_s": round(times[0], 2),
        "measured_steps_s": round(sum(times[1:]), 2),
        "measured_fraction_of_command": round(sum(times[1:]) / command_s, 3),
        # torchrun's own start and exit and the runner's launch: the trainer's process lifetime
        # (marks' `finished`) subtracted from the launch-to-exit wall
        "outside_trainer_process_s": round(trainer_wall - marks.get("finished", 0.0), 2),
        "startup_before_step1_in_trainer_s": round(step1_start, 2),
        "marks_s": marks,
        "compile_cache": record.get("compile_cache"),
        "compile": record.get("startup_compile"),
    }


def show(i: int, s: dict) -> None:
    m = s["marks_s"]
    parts = ", ".join(f"{k} {v:.2f}" for k, v in m.items())
    counts = (s["compile_cache"] or {}).get("counters") or {}
    before = s["startup_before_step1_in_trainer_s"]
    print(f"run {i}: command {s['command_wall_s']:.1f} s, arm {s['arm_wall_s']:.1f} s, step 1 "
          f"{s['step1_s']:.2f} s, start-up before step 1 {before:.2f} s "
          f"in the trainer + {s['outside_trainer_process_s']:.2f} s outside its process, measured "
          f"steps {s['measured_steps_s']:.2f} s = {100 * s['measured_fraction_of_command']:.1f}% "
          f"of the command")  # fmt: skip
    print(f"  marks (s since the trainer process started): {parts}")
    print(f"  compile cache: {json.dumps(counts, sort_keys=True)}")
    if s.get("compile"):
        phases = ", ".join(f"{k} {v:.2f}" for k, v in s["compile"]["phases_s"].items())
        print(f"  compile phases (s, nested): {phases}")
        print(f"  Triton in the trainer's process: {json.dumps(s['compile']['triton_in_process'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--cache", type=Path, help="the compile cache (default OUT_DIR/cache)")
    parser.add_argument("--warm", action="store_true", help="do not empty the cache first")
    parser.add_argument("--pairs", type=int, default=0,
                        help="each run one sweep of this many A/A pairs (-m arm=base,feat "
                             "repeat=0..), each arm reported")  # fmt: skip
    args = parser.parse_args()
    overrides = dict(SHAPES)
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = value
    extra_env = dict(item.partition("=")[::2] for item in args.env)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    cache = (args.cache or out / "cache").resolve()
    if not args.warm:
        shutil.rmtree(cache, ignore_errors=True)  # run 1 is cold
    repo = scratch_repo()
    print("overrides: " + " ".join(f"{k}={v}" for k, v in overrides.items()))
    if extra_env:
        print("environment added: " + " ".join(f"{k}={v}" for k, v in extra_env.items()))
    results = []
    try:
        for i in range(1, args.runs + 1):
            results.append(one_run(i, repo, out, cache, overrides, extra_env, args.pairs))
            for j, arm in enumerate(results[-1] if args.pairs else [results[-1]], 1):
                if args.pairs:
                    print(f"arm {j} ({'-'.join(arm['arm'])}):", end=" ")
                show(i, arm)
    finally:
        shutil.rmtree(repo.parent, ignore_errors=True)
    info = {
        "overrides": overrides,
        "env": extra_env,
        "cache": str(cache),
        "warm_start": args.warm,
        "pairs": args.pairs,
    }
    (out / "startup.json").write_text(json.dumps({**info, "runs": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
