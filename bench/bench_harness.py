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
3. Planted slowdown: commits, on a branch `slow`, a delay of d seconds in the trainer's
   `bench_hook()` (moe_perf/trainer/train.py: a no-op called once per step inside the timed
   region, kept for this), its body replaced: a GPU spin kernel (torch.cuda._sleep,
   calibrated once) on CUDA, where a host sleep would hide behind queued GPU work; time.sleep
   on CPU. With d = --slowdown x the A/A base median step time, then runs the A/B sweep
   refs.feat=slow and reports the measured difference (expected about +100 x --slowdown %).
4. Prints a summary and writes every figure to --out (JSON, schema moe_perf.bench_harness/1).

Each arm runs the trainer of its own commit: the runner puts the arm's worktree first on
PYTHONPATH. The sweep itself runs with the copy first on PYTHONPATH (existing entries kept), so
it works where moe_perf, Hydra and friends come only through PYTHONPATH (no pip install); the
runner then composes the copy's own conf/ (runner/app.py, config_dir). The harness itself uses
this checkout's moe_perf: its git helpers, the launch's output pump and process stopping
(launchers/process.py), the sweep loader and the comparison (report/comparison.py).
`wandb.mode=disabled` is added unless a --set names wandb.mode. Exit status: 0 done, 1 a sweep
or the planted edit failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moe_perf.launchers.process import run_trainer  # noqa: E402
from moe_perf.report.comparison import compare_records, load_sweep  # noqa: E402
from moe_perf.report.results import ArmRecord  # noqa: E402
from moe_perf.runner.git import GitError, dirty_files, git, resolve_ref  # noqa: E402

SCHEMA = "moe_perf.bench_harness/1"
TRAIN_PY = "moe_perf/trainer/train.py"
# The trainer's documented plant point: this function, called once inside the timed step.
HOOK = "bench_hook"
HOOK_LINE = f"def {HOOK}() -> None:"
TIMED_STEP = "train_step"
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
STOP_GRACE_S = 60.0  # a sweep past --sweep-timeout: SIGTERM (it stops its arm), SIGKILL after


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
    records: list[ArmRecord] = field(default_factory=list)
    comparison: dict | None = None
    comparison_source: str | None = None


# ---- the temporary repository ------------------------------------------------------------------


def copy_project(root: Path, ref: str, dest: Path) -> str:
    """A git repository at `dest` on branch `main` whose one commit is `ref`'s tree of `root`.

    Returns the project's commit that was copied.
    """
    sha = resolve_ref(root, ref)
    if sha is None:
        raise BenchError(f"--ref {ref} names no commit in {root}")
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
# an H200), on the host otherwise. It replaces the whole of train.py's no-op `bench_hook`.
PLANTED_HOOK = """\
def bench_hook() -> None:
    # planted by bench/bench_harness.py: {note}
    seconds = {delay_s!r}
    if not torch.cuda.is_available():
        time.sleep(seconds)
        return
    rate = getattr(bench_hook, "cycles_per_s", None)
    if rate is None:  # calibrate the spin kernel once (in step 1, which summaries drop)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(50_000_000)
        end.record()
        end.synchronize()
        rate = bench_hook.cycles_per_s = 50_000_000 / (start.elapsed_time(end) / 1e3)
    torch.cuda._sleep(int(seconds * rate))
"""


def _hook_and_call(text: str) -> tuple[ast.FunctionDef, ast.Call]:
    """train.py's top-level `bench_hook` and its one call, checked to sit in the timed step
    (between `t0 = time.perf_counter()` and `time.perf_counter() - t0` of `train_step`)."""
    tree = ast.parse(text)
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    hook = functions.get(HOOK)
    if hook is None or text.splitlines()[hook.lineno - 1] != HOOK_LINE:
        raise BenchError(f"{TRAIN_PY}: no top-level `{HOOK_LINE}` to plant the slowdown in")
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name) and n.func.id == HOOK]  # fmt: skip
    step = functions.get(TIMED_STEP)
    in_step = [c for c in calls if step and step.lineno <= c.lineno <= step.end_lineno]
    if len(calls) != 1 or len(in_step) != 1:
        raise BenchError(
            f"{TRAIN_PY}: expected one `{HOOK}()` call, in `{TIMED_STEP}`; found {len(calls)} "
            f"({len(in_step)} in {TIMED_STEP})"
        )
    (call,) = in_step
    nodes = list(ast.walk(step))
    starts = [n.lineno for n in nodes if isinstance(n, ast.Assign)
              and ast.unparse(n) == "t0 = time.perf_counter()"]  # fmt: skip
    stops = [n.lineno for n in nodes if isinstance(n, ast.BinOp)
             and ast.unparse(n) == "time.perf_counter() - t0"]  # fmt: skip
    if not any(s < call.lineno for s in starts) or not any(s > call.lineno for s in stops):
        raise BenchError(
            f"{TRAIN_PY}: `{HOOK}()` is not between `t0 = time.perf_counter()` and "
            f"`time.perf_counter() - t0`: a delay there would not be timed"
        )
    return hook, call


def plant_slowdown(text: str, delay_s: float, slowdown: float) -> tuple[str, int]:
    """train.py with `bench_hook`'s body replaced by a delay of `delay_s`; (text, line number
    of the planted hook). The delay is a GPU spin kernel on CUDA, a sleep on CPU (PLANTED_HOOK).

    Fails loudly unless the hook and its call are there as train.py documents them, inside the
    timed region, with `time` and `torch` imported as modules.
    """
    hook, _ = _hook_and_call(text)
    for module in ("time", "torch"):
        if not re.search(rf"^import {module}$", text, re.MULTILINE):
            raise BenchError(f"{TRAIN_PY}: no `import {module}` line; the planted delay needs it")
    lines = text.splitlines(keepends=True)
    note = f"--slowdown {slowdown:g} of the A/A median step"
    planted = PLANTED_HOOK.format(note=note, delay_s=delay_s)
    text = "".join(lines[: hook.lineno - 1]) + planted + "".join(lines[hook.end_lineno :])
    return text, hook.lineno


def commit_slow_branch(repo: Path, delay_s: float, slowdown: float) -> dict[str, Any]:
    """Branch `slow` off `main` with the planted delay; the checkout is back on `main` after."""
    path = repo / TRAIN_PY
    if not path.is_file():
        raise BenchError(f"{TRAIN_PY} is not in the copied project: nothing to plant into")
    planted, line = plant_slowdown(path.read_text(encoding="utf-8"), delay_s, slowdown)
    git(repo, "checkout", "-q", "-b", "slow", "main")
    path.write_text(planted, encoding="utf-8")
    git(repo, "commit", "-q", "-a", "-m", f"plant a {delay_s:.6g} s delay in every timed step")
    sha = git(repo, "rev-parse", "HEAD")
    git(repo, "checkout", "-q", "main")
    return {"branch": "slow", "sha": sha, "file": TRAIN_PY, "line": line, "delay_s": delay_s}


# ---- running a sweep ---------------------------------------------------------------------------


def sweep_command(
    repo: Path, overrides: Sequence[str], feat_ref: str, sweep_dir: Path, repeats: int
) -> list[str]:
    # one pair per repeat index: fixed repeats, or exactly one pair (the harness times arms,
    # not the verdict's pairs until decided)
    swept = [f"repeat={','.join(str(r) for r in range(repeats))}"] if repeats > 1 else []
    one_pair = [] if repeats > 1 else ["compare.max_pairs=1"]
    return [
        sys.executable, "-m", "moe_perf",
        *overrides,
        "refs.base=main", f"refs.feat={feat_ref}",
        f"hydra.sweep.dir={sweep_dir}", *one_pair,
        "-m", *swept, "arm=base,feat",
    ]  # fmt: skip


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def read_comparison(sweep_dir: Path, records: list[ArmRecord],
                    notes: list[str]) -> tuple[dict, str]:  # fmt: skip
    """comparison.json as the sweep's callback wrote it; else the comparison of its records."""
    path = sweep_dir / "comparison.json"
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8")), "comparison.json"
    report = compare_records(records, notes, sweep_dir=str(sweep_dir)).to_dict()
    return report, "moe_perf.report.comparison of the records (no comparison.json)"


def run_sweep(
    name: str, *, repo: Path, work: Path, overrides: Sequence[str], feat_ref: str, args
) -> Sweep:
    sweep_dir = work / "sweeps" / name
    log_dir = work / "logs" / name
    sweep = Sweep(
        name=name,
        command=sweep_command(repo, overrides, feat_ref, sweep_dir, args.repeats),
        sweep_dir=sweep_dir,
        log=log_dir / "console.log",
    )
    print(f"[bench] {name}: {shlex.join(sweep.command[1:])}", flush=True)
    log_dir.mkdir(parents=True)
    # The runner's own launch code runs the sweep as it runs an arm: its output to the log (and
    # the console with -v), the copy first on PYTHONPATH, and past the timeout SIGTERM (the
    # runner stops its arm and removes the worktree), SIGKILL later. The sweep prints no step
    # lines of the trainer contract, so the launch's own step figures and failure are not used.
    quiet = open(os.devnull, "w") if not args.verbose else contextlib.nullcontext(sys.stdout)
    with quiet as echo:
        result = run_trainer(
            sweep.command,
            cwd=repo,
            arm_dir=log_dir,
            label=name,
            timeout_s=args.sweep_timeout,
            kill_grace_s=STOP_GRACE_S,
            max_steps=0,
            echo=echo,
        )
    sweep.wall_s = result.trainer_wall_s
    if result.timed_out:
        raise BenchError(
            f"the sweep ran past {args.sweep_timeout:g} s (--sweep-timeout) and was stopped; "
            f"see {sweep.log}"
        )
    if result.launch_exit_code != 0:
        raise BenchError(
            f"the {name} sweep failed with exit code {result.launch_exit_code}; last lines of "
            f"{sweep.log}:\n{tail(sweep.log)}"
        )
    records, notes = load_sweep(sweep_dir)
    for note in notes:
        print(f"[bench] {name}: {note}", flush=True)
    sweep.records = sorted(records, key=lambda r: str(r.started))  # run order
    arms = {r.arm for r in sweep.records}
    if not {"base", "feat"} <= arms:
        raise BenchError(
            f"the {name} sweep exited 0 but left records of arms {sorted(map(str, arms))} in "
            f"{sweep_dir}, not base and feat; see {sweep.log}"
        )
    failed = [r for r in sweep.records if not r.ok]
    if failed:
        why = "; ".join(f"{r.arm} r{r.repeat}: {r.failure}" for r in failed)
        raise BenchError(f"the {name} sweep exited 0 but arms failed: {why}; see {sweep.log}")
    sweep.comparison, sweep.comparison_source = read_comparison(sweep_dir, records, notes)
    return sweep


# ---- figures -----------------------------------------------------------------------------------


def arm_figures(record: ArmRecord) -> dict[str, Any]:
    steps_s = sum(s.step_time_s for s in record.steps if s.step_time_s is not None)
    wall, trainer = float(record.wall_time_s), float(record.trainer_wall_s)
    return {
        "arm": record.arm,
        "repeat": record.repeat,
        "sha": record.sha,
        "metrics_json": str(record.path),
        "wall_time_s": wall,
        "trainer_wall_s": trainer,
        # worktree, config, launch bookkeeping and the record: the runner's part inside an arm
        "in_arm_overhead_s": round(wall - trainer, 3),
        # torchrun, torch import, model build, exit: the trainer's part outside its timed steps
        "trainer_outside_steps_s": round(trainer - steps_s, 3),
        "steps_sum_s": round(steps_s, 4),
        "median_step_time_s": record.summary.step_time_s,
        "median_tokens_per_s": record.summary.tokens_per_s,
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


def environment_of(records: list[ArmRecord]) -> dict[str, Any]:
    env = records[0].environment or {}
    return {
        **{key: env.get(key) for key in ENV_KEYS},
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


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
    dirty = dirty_files(ROOT)
    sha = copy_project(ROOT, args.ref, repo)
    print(f"[bench] copied {ROOT} @ {sha[:12]} to {repo} (branch main)", flush=True)
    if dirty and args.ref == "HEAD":
        note = f"{len(dirty)} uncommitted change(s) in {ROOT} are not measured (copy of HEAD)"
        print(f"[bench] note: {note}", flush=True)

    aa = run_sweep("aa", repo=repo, work=work, overrides=args.overrides, feat_ref="main", args=args)
    aa_figures = sweep_figures(aa)
    # the comparison's base median (median of run medians) of the group the report leads with
    base_median = aa_figures["groups"][0]["base_step_time_s"]
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
    first_aa, first_planted = aa_figures["groups"][0], planted_figures["groups"][0]
    planted_base = first_planted["base_step_time_s"]
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
    # every git command of the harness and of its sweeps runs with the harness's identity
    os.environ.update(GIT_IDENTITY)
    try:
        report = bench(args, work)
    except (BenchError, GitError) as err:
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
