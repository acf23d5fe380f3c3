"""Benchmark the runner's harness through the real `python -m moe_perf` command.

    python bench/bench_harness.py                        # defaults: tiny model, 8 steps
    python bench/bench_harness.py --set training.sequence_length=64 \
        --set training.global_batch=4 --set training.max_steps=4     # a quick CPU run
    python bench/bench_harness.py --set model=qwen3-30b-a3b --set mesh=ep8 --repeats 3
    python bench/bench_harness.py --slowdown 0.10 --out /tmp/harness.json --keep -v

What it does, in a temporary directory (removed at the end; kept with --keep or after a
failure):

1. Copies this project's committed tree (`--ref`, default HEAD; uncommitted changes are not
   measured) into a fresh git repository on branch `main`, with a git identity of its own.
2. A/A sweep: `python -m moe_perf <--set overrides> refs.base=main refs.feat=main -m arm=base,feat`
   (`-m repeat=0,..,N-1 arm=base,feat` with --repeats N), cwd = that repository. It reports
   the sweep's wall time, each arm's `wall_time_s` and `trainer_wall_s` (metrics.json), the
   harness overhead per arm = (sweep wall time - sum of trainer_wall_s) / arms, and the A/A
   difference of median step time and tokens/s (comparison.json).
3. Planted slowdown: commits, on a branch `slow`, a delay of d seconds right before the
   `optimizer.step()` line of moe_perf/trainer/train.py (inside the timed region): a GPU spin
   kernel (torch.cuda._sleep, calibrated once) on CUDA, where a host sleep would hide behind
   queued GPU work; time.sleep on CPU. With
   d = --slowdown x the A/A base median step time, then runs the A/B sweep refs.feat=slow and
   reports the measured difference (expected about +100 x --slowdown %).
4. Prints a summary and writes every figure to --out (JSON, schema moe_perf.bench_harness/1).

Each arm runs the trainer of its own commit: the runner puts the arm's worktree first on
PYTHONPATH (moe_perf/launch.py). The sweep itself runs with the copy first on PYTHONPATH
(existing entries kept), so it works where moe_perf, Hydra and friends come only through
PYTHONPATH (no pip install); the runner then composes the copy's own conf/ (cli.config_dir).
`wandb.mode=disabled` is added unless a --set names wandb.mode. Exit status: 0 done, 1 a sweep
or the planted edit failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "moe_perf.bench_harness/1"
TRAIN_PY = "moe_perf/trainer/train.py"
# The planted sleep goes right before this line, which must sit between the step's two timing
# points (`t0 = time.perf_counter()` ... `time.perf_counter() - t0`).
ANCHOR_RE = re.compile(r"^(?P<indent>[ \t]+)optimizer\.step\(\)[ \t]*$", re.MULTILINE)
TIMER_START_RE = re.compile(r"^[ \t]+t0 = time\.perf_counter\(\)[ \t]*$", re.MULTILINE)
TIMER_STOP_RE = re.compile(r"time\.perf_counter\(\) - t0\b")
# Keys the harness sets itself; a --set of any of them would change what is measured.
OWNED_KEYS = ("refs.base", "refs.feat", "hydra.sweep.dir", "arm", "repeat", "repo")
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "moe_perf bench_harness",
    "GIT_AUTHOR_EMAIL": "bench@moe-perf.invalid",
    "GIT_COMMITTER_NAME": "moe_perf bench_harness",
    "GIT_COMMITTER_EMAIL": "bench@moe-perf.invalid",
    # the machine's or the user's git config (hooks, signing, default branch) stays out
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}
ENV_KEYS = ("host", "python", "torch", "cuda", "nccl", "devices", "world_size")


class BenchError(RuntimeError):
    """A step of the benchmark failed; the message says which and where to look."""


@dataclass
class Sweep:
    """One `python -m moe_perf ... -m ...` run and what it left behind."""

    name: str
    command: list[str]
    sweep_dir: Path
    log: Path
    wall_s: float = 0.0
    records: list[dict] = field(default_factory=list)
    comparison: dict | None = None
    comparison_source: str | None = None


# ---- git and the temporary repository ----------------------------------------------------------


def git(repo: Path, *args: str, strip: bool = True) -> str:
    result = subprocess.run(
        ["git", "-C", str(repo), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **GIT_IDENTITY},
        check=False,
    )
    if result.returncode != 0:
        raise BenchError(f"git {' '.join(args)} in {repo} failed: {result.stderr.strip()}")
    return result.stdout.strip() if strip else result.stdout


def copy_project(root: Path, ref: str, dest: Path) -> str:
    """A git repository at `dest` on branch `main` whose one commit is `ref`'s tree of `root`.

    Returns the project's commit that was copied.
    """
    sha = git(root, "rev-parse", "--verify", f"{ref}^{{commit}}")
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", "--format=tar", sha], capture_output=True, check=False
    )
    if archive.returncode != 0:
        raise BenchError(f"git archive {sha} failed: {archive.stderr.decode().strip()}")
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4
            tar.extractall(dest, filter="data")
        else:
            tar.extractall(dest)  # our own git archive
    git(dest, "init", "-q", "-b", "main")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", f"moe_perf at {sha[:12]} (copied by bench_harness)")
    return sha


# The planted delay runs where the step's time is spent: on the GPU's stream when there is one
# (a host sleep would hide behind the GPU work already queued: measured +0.05% for a 5% sleep on
# an H200), on the host otherwise. Inserted before train.py's first top-level def/class.
PLANTED_FN = """\
def _planted_delay(seconds: float) -> None:  # planted by bench/bench_harness.py
    if not torch.cuda.is_available():
        time.sleep(seconds)
        return
    rate = getattr(_planted_delay, "cycles_per_s", None)
    if rate is None:  # calibrate the spin kernel once (in step 1, which summaries drop)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(50_000_000)
        end.record()
        end.synchronize()
        rate = _planted_delay.cycles_per_s = 50_000_000 / (start.elapsed_time(end) / 1e3)
    torch.cuda._sleep(int(seconds * rate))


"""
# a top-level definition, its decorators included (the delay goes before the first one)
TOP_LEVEL_DEF_RE = re.compile(r"^(@|def |class )", re.MULTILINE)


def plant_slowdown(text: str, delay_s: float, slowdown: float) -> tuple[str, int]:
    """train.py delayed by `delay_s` right before `optimizer.step()`; (text, line number of
    the planted call). The delay is `_planted_delay` (PLANTED_FN): a GPU spin kernel on CUDA,
    a sleep on CPU.

    Fails loudly unless the anchor is there exactly once, inside the timed region, with `time`
    and `torch` imported as modules.
    """
    anchors = list(ANCHOR_RE.finditer(text))
    if len(anchors) != 1:
        raise BenchError(
            f"{TRAIN_PY}: expected exactly one `optimizer.step()` line to plant the slowdown "
            f"before, found {len(anchors)}; bench/bench_harness.py needs a new anchor"
        )
    anchor = anchors[0]
    start = [m.end() for m in TIMER_START_RE.finditer(text) if m.end() < anchor.start()]
    stop = [m.start() for m in TIMER_STOP_RE.finditer(text) if m.start() > anchor.end()]
    if not start or not stop:
        raise BenchError(
            f"{TRAIN_PY}: `optimizer.step()` is not between `t0 = time.perf_counter()` and "
            f"`time.perf_counter() - t0`: a sleep there would not be timed; update the anchor"
        )
    for module in ("time", "torch"):
        if not re.search(rf"^import {module}$", text, re.MULTILINE):
            raise BenchError(f"{TRAIN_PY}: no `import {module}` line; the planted delay needs it")
    first_def = TOP_LEVEL_DEF_RE.search(text)
    if first_def is None or first_def.start() > anchor.start():
        raise BenchError(f"{TRAIN_PY}: no top-level def before the step to plant the delay at")
    call = (
        f"{anchor['indent']}_planted_delay({delay_s!r})  "
        f"# planted by bench/bench_harness.py: --slowdown {slowdown:g} of the A/A median step\n"
    )
    planted = (
        text[: first_def.start()]
        + PLANTED_FN
        + text[first_def.start() : anchor.start()]
        + call
        + text[anchor.start() :]
    )
    return planted, planted.count("\n", 0, planted.index(call)) + 1


def commit_slow_branch(repo: Path, delay_s: float, slowdown: float) -> dict[str, Any]:
    """Branch `slow` off `main` with the planted sleep; the checkout is back on `main` after."""
    path = repo / TRAIN_PY
    if not path.is_file():
        raise BenchError(f"{TRAIN_PY} is not in the copied project: nothing to plant into")
    planted, line = plant_slowdown(path.read_text(encoding="utf-8"), delay_s, slowdown)
    git(repo, "checkout", "-q", "-b", "slow", "main")
    path.write_text(planted, encoding="utf-8")
    git(repo, "commit", "-q", "-a", "-m", f"plant a {delay_s:.6g} s sleep in every timed step")
    sha = git(repo, "rev-parse", "HEAD")
    git(repo, "checkout", "-q", "main")
    return {"branch": "slow", "sha": sha, "file": TRAIN_PY, "line": line, "delay_s": delay_s}


# ---- running a sweep ---------------------------------------------------------------------------


def sweep_env(repo: Path) -> dict[str, str]:
    """The caller's environment, the copy first on PYTHONPATH (existing entries kept)."""
    env = {**os.environ, **GIT_IDENTITY, "PYTHONUNBUFFERED": "1"}
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(repo), *kept])
    return env


def sweep_command(
    repo: Path, overrides: Sequence[str], feat_ref: str, sweep_dir: Path, repeats: int
) -> list[str]:
    swept = [f"repeat={','.join(str(r) for r in range(repeats))}"] if repeats > 1 else []
    return [
        sys.executable, "-m", "moe_perf",
        *overrides,
        "refs.base=main", f"refs.feat={feat_ref}",
        f"hydra.sweep.dir={sweep_dir}",
        "-m", *swept, "arm=base,feat",
    ]  # fmt: skip


def run_logged(
    command: list[str], *, cwd: Path, env: dict[str, str], log: Path, echo: bool, timeout_s: float
) -> tuple[int, float]:
    """Run `command`, its output to `log` (and the console with `echo`); (exit code, wall s).

    The wall time is taken around the process alone. Past `timeout_s` the sweep gets SIGTERM
    (the runner stops its arm and removes the worktree), SIGKILL 60 s later.
    """
    with open(log, "w", encoding="utf-8") as out:
        out.write(f"# cwd: {cwd}\n# {shlex.join(command)}\n")
        out.flush()
        start = time.perf_counter()
        proc = subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
                if echo:
                    sys.stdout.write(line)
                    sys.stdout.flush()

        reader = threading.Thread(target=pump, name="sweep-output", daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=timeout_s)
            wall_s = time.perf_counter() - start
        except subprocess.TimeoutExpired:
            stop(proc)
            raise BenchError(
                f"the sweep ran past {timeout_s:g} s (--sweep-timeout) and was stopped; see {log}"
            ) from None
        except KeyboardInterrupt:
            # Ctrl-C reached the sweep too (same process group): it stops its arm and removes
            # the worktree; a second signal now could cut that short, so wait first
            stop(proc, wait_first_s=60)
            raise
        finally:
            reader.join(timeout=10)
    return code, wall_s


def stop(proc: subprocess.Popen, wait_first_s: float = 0.0) -> None:
    """SIGTERM (the runner's Ctrl-C path), SIGKILL 60 s later; optionally wait before both."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=wait_first_s)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def read_records(sweep_dir: Path) -> list[dict]:
    """Every metrics.json of this sweep directory (earlier runs moved to previous/ skipped)."""
    records = []
    for path in sorted(sweep_dir.rglob("metrics.json")):
        if "previous" in path.relative_to(sweep_dir).parts:
            continue
        record = json.loads(path.read_text(encoding="utf-8"))
        record["_path"] = str(path)
        records.append(record)
    return sorted(records, key=lambda r: str(r.get("started")))  # run order


def read_comparison(
    sweep_dir: Path, *, cwd: Path, env: dict[str, str]
) -> tuple[dict | None, str | None]:
    """comparison.json as the sweep's callback wrote it; else the runner's own compare tool."""
    path = sweep_dir / "comparison.json"
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8")), "comparison.json"
    result = subprocess.run(
        [sys.executable, "-m", "moe_perf.compare", str(sweep_dir), "--json", "--no-write"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        return None, None
    return json.loads(result.stdout), "python -m moe_perf.compare --json (no comparison.json)"


def run_sweep(
    name: str, *, repo: Path, work: Path, overrides: Sequence[str], feat_ref: str, args
) -> Sweep:
    sweep_dir = work / "sweeps" / name
    sweep = Sweep(
        name=name,
        command=sweep_command(repo, overrides, feat_ref, sweep_dir, args.repeats),
        sweep_dir=sweep_dir,
        log=work / f"{name}.log",
    )
    env = sweep_env(repo)
    print(f"[bench] {name}: {shlex.join(sweep.command[1:])}", flush=True)
    code, sweep.wall_s = run_logged(
        sweep.command,
        cwd=repo,
        env=env,
        log=sweep.log,
        echo=args.verbose,
        timeout_s=args.sweep_timeout,
    )
    if code != 0:
        raise BenchError(
            f"the {name} sweep failed with exit code {code}; last lines of {sweep.log}:\n"
            f"{tail(sweep.log)}"
        )
    sweep.records = read_records(sweep_dir)
    arms = {r.get("arm") for r in sweep.records}
    if not {"base", "feat"} <= arms:
        raise BenchError(
            f"the {name} sweep exited 0 but left records of arms {sorted(map(str, arms))} in "
            f"{sweep_dir}, not base and feat; see {sweep.log}"
        )
    failed = [r for r in sweep.records if r.get("status") != "ok"]
    if failed:
        why = "; ".join(f"{r['arm']} r{r.get('repeat', 0)}: {r.get('failure')}" for r in failed)
        raise BenchError(f"the {name} sweep exited 0 but arms failed: {why}; see {sweep.log}")
    sweep.comparison, sweep.comparison_source = read_comparison(sweep_dir, cwd=repo, env=env)
    if sweep.comparison is None:
        raise BenchError(f"the {name} sweep left no comparison in {sweep_dir}; see {sweep.log}")
    return sweep


# ---- figures -----------------------------------------------------------------------------------


def arm_figures(record: dict) -> dict[str, Any]:
    steps_s = sum(s["step_time_s"] for s in record["steps"] if s.get("step_time_s") is not None)
    wall, trainer = float(record["wall_time_s"]), float(record["trainer_wall_s"])
    return {
        "arm": record["arm"],
        "repeat": record.get("repeat", 0),
        "sha": record.get("sha"),
        "metrics_json": record["_path"],
        "wall_time_s": wall,
        "trainer_wall_s": trainer,
        # worktree, config, launch bookkeeping and the record: the runner's part inside an arm
        "in_arm_overhead_s": round(wall - trainer, 3),
        # torchrun, torch import, model build, exit: the trainer's part outside its timed steps
        "trainer_outside_steps_s": round(trainer - steps_s, 3),
        "steps_sum_s": round(steps_s, 4),
        "median_step_time_s": record["summary"]["step_time_s"],
        "median_tokens_per_s": record["summary"]["tokens_per_s"],
    }


def group_figures(group: dict) -> dict[str, Any]:
    def pct(key: str) -> float | None:
        diff = (group.get("difference") or {}).get(key)
        return diff["pct"] if diff else None

    def median(arm: str, key: str) -> float | None:
        stat = (group["arms"].get(arm) or {}).get(key)
        return stat["median"] if stat else None

    return {
        "model": group["model"],
        "tag": group["tag"],
        "status": group["status"],
        "aa": group.get("aa"),
        "base_step_time_s": median("base", "step_time_s"),
        "feat_step_time_s": median("feat", "step_time_s"),
        "base_tokens_per_s": median("base", "tokens_per_s"),
        "feat_tokens_per_s": median("feat", "tokens_per_s"),
        "step_time_pct": pct("step_time_s"),
        # with repeats: do the arms' min-max ranges of run medians overlap (None: one run)
        "step_time_within_spread": ((group.get("difference") or {}).get("step_time_s") or {}).get(
            "within_spread"
        ),
        "tokens_per_s_pct": pct("tokens_per_s"),
    }


def sweep_figures(sweep: Sweep) -> dict[str, Any]:
    arms = [arm_figures(r) for r in sweep.records]
    trainer_sum = sum(a["trainer_wall_s"] for a in arms)
    arm_wall_sum = sum(a["wall_time_s"] for a in arms)
    groups = [group_figures(g) for g in sweep.comparison["groups"]]
    if any(g["status"] != "compared" for g in groups):
        bad = ", ".join(f"{g['tag']}: {g['status']}" for g in groups if g["status"] != "compared")
        raise BenchError(f"the {sweep.name} sweep's comparison is not complete ({bad})")
    return {
        "command": sweep.command,
        "command_line": shlex.join(sweep.command),
        "sweep_dir": str(sweep.sweep_dir),
        "log": str(sweep.log),
        "wall_s": round(sweep.wall_s, 3),
        "arms_run": len(arms),
        "trainer_wall_sum_s": round(trainer_sum, 3),
        "harness_overhead_per_arm_s": round((sweep.wall_s - trainer_sum) / len(arms), 3),
        # Python and Hydra start-up, the sweep's checks, the comparison and its plot
        "outside_arms_s": round(sweep.wall_s - arm_wall_sum, 3),
        "arms": arms,
        "comparison_source": sweep.comparison_source,
        "groups": groups,
    }


def environment_of(records: list[dict]) -> dict[str, Any]:
    env = records[0].get("environment") or {}
    return {
        **{key: env.get(key) for key in ENV_KEYS},
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def base_median_step(sweep: Sweep) -> float:
    """Median of the base runs' median step times (all groups of the sweep)."""
    values = [r["summary"]["step_time_s"] for r in sweep.records if r["arm"] == "base"]
    return statistics.median(v for v in values if v is not None)


def fmt_pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}%"


def summary_lines(report: dict) -> list[str]:
    aa, planted = report["sweeps"]["aa"], report["sweeps"]["planted"]
    env = report["environment"]
    devices = ", ".join(env["devices"] or []) or "CPU"
    lines = [
        f"moe_perf harness benchmark ({report['project']['sha'][:12]}, {devices}, "
        f"torch {env['torch']}, world {env['world_size']}, {report['settings']['repeats']} "
        f"run(s) per arm)",
    ]
    for name, sweep in (("A/A", aa), ("planted", planted)):
        per_arm = ", ".join(
            f"{a['arm']}{'' if report['settings']['repeats'] == 1 else ' r' + str(a['repeat'])} "
            f"{a['wall_time_s']:.2f}-{a['trainer_wall_s']:.2f}={a['in_arm_overhead_s']:.2f}"
            for a in sweep["arms"]
        )
        lines.append(
            f"  {name:8s} sweep {sweep['wall_s']:.2f} s, trainers "
            f"{sweep['trainer_wall_sum_s']:.2f} s"
            f" -> harness overhead {sweep['harness_overhead_per_arm_s']:.2f} s/arm "
            f"(outside arms {sweep['outside_arms_s']:.2f} s; in arm wall-trainer s: {per_arm})"
        )
    for group in aa["groups"]:
        lines.append(
            f"  A/A {group['tag']}: step time {fmt_pct(group['step_time_pct'])}, tokens/s "
            f"{fmt_pct(group['tokens_per_s_pct'])} (base {group['base_step_time_s']:.4f} s)"
        )
    plant = report["planted_slowdown"]
    for group in planted["groups"]:
        lines.append(
            f"  planted {plant['delay_s']:.4g} s/step (expected {fmt_pct(plant['expected_pct'])}) "
            f"{group['tag']}: step time {fmt_pct(group['step_time_pct'])}, tokens/s "
            f"{fmt_pct(group['tokens_per_s_pct'])}"
        )
    return lines


# ---- main --------------------------------------------------------------------------------------


def check_overrides(overrides: list[str]) -> list[str]:
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if "=" not in item or item.startswith("-"):
            raise ValueError(f"--set wants KEY=VALUE, got {item!r}")
        if key in OWNED_KEYS:
            raise ValueError(f"--set {key}=... is set by the harness itself")
    if not any(item.split("=", 1)[0].lstrip("+~") == "wandb.mode" for item in overrides):
        overrides = [*overrides, "wandb.mode=disabled"]  # wandb would count as overhead
    return overrides


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override of `python -m moe_perf`, for both sweeps (repeatable)",
    )
    p.add_argument(
        "--slowdown",
        type=float,
        default=0.05,
        help="planted per-step delay as a fraction of the A/A base median step time",
    )
    p.add_argument("--repeats", type=int, default=1, help="runs per arm (-m repeat=0,..,N-1)")
    p.add_argument("--ref", default="HEAD", help="the project commit to copy (default HEAD)")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "harness.json")
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where the temporary directory goes (default: the system's)",
    )
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.add_argument(
        "--sweep-timeout",
        type=float,
        default=7200.0,
        metavar="S",
        help="stop a sweep that runs longer than this (seconds)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="show the sweeps' output")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.slowdown <= 0:
        p.error("--slowdown must be positive")
    try:
        args.overrides = check_overrides(args.overrides)
    except ValueError as err:
        p.error(str(err))
    return args


def bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    repo = work / "repo"
    dirty = [line[3:] for line in git(ROOT, "status", "--porcelain", strip=False).splitlines()]
    sha = copy_project(ROOT, args.ref, repo)
    print(f"[bench] copied {ROOT} @ {sha[:12]} to {repo} (branch main)", flush=True)
    if dirty and args.ref == "HEAD":
        note = f"{len(dirty)} uncommitted change(s) in {ROOT} are not measured (copy of HEAD)"
        print(f"[bench] note: {note}", flush=True)

    aa = run_sweep("aa", repo=repo, work=work, overrides=args.overrides, feat_ref="main", args=args)
    aa_figures = sweep_figures(aa)
    base_median = base_median_step(aa)
    delay_s = round(args.slowdown * base_median, 6)
    if delay_s <= 0:
        raise BenchError(f"A/A base median step time {base_median} s gives no delay to plant")
    slow = commit_slow_branch(repo, delay_s, args.slowdown)
    print(
        f"[bench] planted a {delay_s} s delay at {TRAIN_PY}:{slow['line']} on branch slow",
        flush=True,
    )

    planted = run_sweep(
        "planted", repo=repo, work=work, overrides=args.overrides, feat_ref="slow", args=args
    )
    planted_figures = sweep_figures(planted)
    planted_base = base_median_step(planted)
    first_aa, first_planted = aa_figures["groups"][0], planted_figures["groups"][0]
    return {
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds"),
        "project": {
            "root": str(ROOT),
            "ref": args.ref,
            "sha": sha,
            "uncommitted_not_measured": dirty,
        },
        "settings": {
            "overrides": args.overrides,
            "slowdown": args.slowdown,
            "repeats": args.repeats,
            "workdir": str(work),
            "kept": args.keep,
        },
        "environment": environment_of(aa.records),
        "sweeps": {"aa": aa_figures, "planted": planted_figures},
        "harness_overhead_per_arm_s": {
            "aa": aa_figures["harness_overhead_per_arm_s"],
            "planted": planted_figures["harness_overhead_per_arm_s"],
        },
        "aa_diff_pct": {
            "step_time_s": first_aa["step_time_pct"],
            "tokens_per_s": first_aa["tokens_per_s_pct"],
        },
        "planted_slowdown": {
            **slow,
            "slowdown": args.slowdown,
            "aa_base_median_step_s": base_median,
            "expected_pct": args.slowdown * 100.0,
            # the same delay against this sweep's own base median
            "expected_pct_vs_this_base": delay_s / planted_base * 100.0,
            "measured_step_time_pct": first_planted["step_time_pct"],
            "measured_tokens_per_s_pct": first_planted["tokens_per_s_pct"],
        },
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="moe_perf_bench_harness-", dir=args.workdir))
    keep = args.keep
    try:
        report = bench(args, work)
    except BenchError as err:
        keep = True
        print(f"bench_harness: {err}", file=sys.stderr)
        print(f"bench_harness: kept {work} for a look", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"bench_harness: interrupted; {work} left as it was", file=sys.stderr)
        keep = True
        return 130
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print("\n".join(summary_lines(report)))
    print(f"[bench] figures written to {args.out}" + (f"; kept {work}" if keep else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
