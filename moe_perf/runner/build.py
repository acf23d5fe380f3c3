"""`trainer.build`: a commit's build step, in its worktree, before the first arm of that commit.

A branch that changes compiled code (a C++ or CUDA extension of the repository) must be built
in each arm's own tree, or its arm fails at import or, worse, imports the copy installed in the
shared environment: the base branch's kernel in both arms. The build command (an argument
list, with trainer.command's placeholders and `{python}`) runs in the commit's worktree with
the arm's environment (the same PYTHONPATH, compile caches and trainer env; PATH led by the
arms' virtual environment, as activating it would), through the launcher (under SLURM as an
srun task, launchers/slurm.py), all its output in `<arm dir>/build.log`, before the launch: its
time is in the record (`build`), never in a step.

Once per commit: the worktree of a commit lives for the whole sweep (SweepSession.worktree_for),
and `<sweep dir>/.moe_perf/builds.json` says what was built in it, so later arms of the commit
(repeats, pairs, the other arm of an A/A run) reuse the build, or its failure.
`trainer.build_cache` reuses it across sweeps (build_cache.py).

Every arm of a sweep with a build starts from the environment the sweep found: the installed
packages are listed before the sweep's first build and again after each build and before each
arm (build_isolation.py); an arm that would start from a changed environment is refused, with
what changed and how to build in place or into a per-arm prefix instead.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_perf.common.errors import PrerequisiteError
from moe_perf.frameworks.command import arm_values, fill, fill_env
from moe_perf.launchers.failures import build_error
from moe_perf.launchers.process import run_logged, trainer_env
from moe_perf.report.record import now_iso
from moe_perf.report.results.files import write_json
from moe_perf.report.sweep import STATE_DIR, Sweep
from moe_perf.runner import build_cache, build_isolation
from moe_perf.runner.job import Job, say

BUILD_LOG = "build.log"
STATE = "builds.json"  # in the sweep's state directory: {"environment", "commits": {sha: ...}}


@dataclass(frozen=True)
class BuildStep:
    """One arm's build command, as configured and as it runs."""

    configured: list[str]  # trainer.build, placeholders unfilled: the same for every arm
    argv: list[str]  # filled for this arm's worktree, wrapped by the launcher
    timeout_s: float
    cache_dir: Path | None  # trainer.build_cache; None: off


def configured_build(cfg: Any) -> list[str]:
    return [str(part) for part in cfg.trainer.get("build") or []]


def build_step(cfg: Any, arm_dir: Path, worktree: Path, label: str, launcher: Any) -> BuildStep:
    configured = configured_build(cfg)
    values = arm_values(cfg, arm_dir, arm_dir / "config.yaml", worktree)
    filled = fill(configured, cfg, values, "trainer.build")
    return BuildStep(configured, launcher.build_argv(cfg, label, filled),
                     float(cfg.trainer.get("build_timeout_s", 3600)),
                     build_cache.cache_root(cfg.trainer.get("build_cache", "off")))  # fmt: skip


def check(cfg: Any) -> None:
    """Before anything launches: the trainer env's and the build's placeholders fill, the
    build's program exists, the modules to verify are module names."""
    here = Path.cwd()
    values = arm_values(cfg, here, here / "config.yaml", here)
    fill_env(trainer_env_setting(cfg), cfg, values)
    for name in cfg.trainer.get("verify_imports") or []:
        if not all(part.isidentifier() for part in str(name).split(".")):
            raise PrerequisiteError(
                f"trainer.verify_imports: {name!r} is not a module name (e.g. my_ext or my_pkg._C)"
            )
    if configured_build(cfg):
        check_program(fill(configured_build(cfg), cfg, values, "trainer.build")[0])


def check_program(program: str) -> None:
    if "/" not in program and shutil.which(program, path=build_path(os.environ["PATH"])) is None:
        raise PrerequisiteError(
            f"trainer.build: `{program}` is not on PATH; name the program by its path, or "
            f"{{python}} for the arms' interpreter"
        )


def trainer_env_setting(cfg: Any) -> dict[str, str]:
    """trainer.env as configured (placeholders unfilled)."""
    return {str(k): str(v) for k, v in (cfg.trainer.get("env") or {}).items()}


def build_path(path: str) -> str:
    """PATH for a build: led by the arms' virtual environment (python, pip and the tools it
    installed are the arms' own), as activating it would; unchanged outside one."""
    if sys.prefix == sys.base_prefix:
        return path
    return os.pathsep.join([str(Path(sys.executable).parent), path])


# ---- the sweep's state of builds -------------------------------------------------------------


def _state_path(sweep: Sweep) -> Path:
    return Path(sweep.sweep_dir) / STATE_DIR / STATE


def read_state(sweep: Sweep) -> dict:
    try:
        state = json.loads(_state_path(sweep).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        state = {}
    return {"environment": state.get("environment"), "commits": state.get("commits") or {}}


def save_state(sweep: Sweep, state: dict) -> None:
    _state_path(sweep).parent.mkdir(parents=True, exist_ok=True)
    write_json(_state_path(sweep), state)


# ---- one arm ---------------------------------------------------------------------------------


@dataclass
class ArmBuild:
    """Everything one arm's build needs: where, with what, and for which commit."""

    cfg: Any
    job: Job
    sweep: Sweep
    label: str
    sha: str
    worktree: Path
    env: dict[str, str]  # what the arm adds to the runner's environment (trainer_env's extra)
    step: BuildStep

    def full_env(self) -> dict[str, str]:
        return trainer_env(self.worktree, self.job.arm_dir, "build", self.env,
                           Path(self.sweep.repo))  # fmt: skip

    def snapshot(self) -> dict[str, str]:
        """The shared environment as the arms' interpreter sees it (build_isolation)."""
        return build_isolation.snapshot(self.full_env(), [self.worktree, self.job.arm_dir])


def ensure_built(arm: ArmBuild) -> dict:
    """The record's `build` for this arm: the commit built (or restored from the cache) by
    its first arm, reused by the later ones; `status` ok, failed or refused, with `failure`."""
    state = read_state(arm.sweep)
    if state["environment"] is None:  # before the sweep's first build
        state["environment"] = arm.snapshot()
        save_state(arm.sweep, state)
    done = state["commits"].get(arm.sha)
    if done is not None and done["worktree"] == str(arm.worktree):
        outcome = {**done, "reused": True, "wall_s": 0.0}
    else:
        outcome = build_commit(arm)
        state["commits"][arm.sha] = outcome
        save_state(arm.sweep, state)
    if outcome["status"] == "ok":
        changed = build_isolation.changes(state["environment"], arm.snapshot())
        if changed:
            outcome = {**outcome, "status": "refused", "environment_changes": changed,
                       "failure": build_isolation.refusal(changed)}  # fmt: skip
            if not outcome["reused"]:
                state["commits"][arm.sha] = outcome
                save_state(arm.sweep, state)
    return outcome


def build_commit(arm: ArmBuild) -> dict:
    """The commit's build: restored from the cache when it holds it, else run (and stored)."""
    cache = None
    if arm.step.cache_dir is not None:
        tools = build_cache.toolchain({**arm.full_env(), "PATH": _path(arm)})
        cache = {"dir": str(arm.step.cache_dir), "key": build_cache.build_key(
            arm.sha, arm.step.configured, trainer_env_setting(arm.cfg), tools)}  # fmt: skip
        restored = restore(arm, cache)
        if restored is not None:
            return restored
    outcome = run_build(arm, cache)
    if cache is not None and outcome["status"] == "ok":
        about = {"sha": arm.sha, "build": arm.step.configured, "built": now_iso(),
                 "build_wall_s": outcome["build_wall_s"], "repo": arm.sweep.repo}  # fmt: skip
        stored = build_cache.store(arm.step.cache_dir, cache["key"], arm.worktree, about)
        outcome["cache"]["stored"] = stored is not None
    return outcome


def _path(arm: ArmBuild) -> str:
    return build_path(arm.env.get("PATH") or os.environ.get("PATH", ""))


def _outcome(arm: ArmBuild, **fields) -> dict:
    return {"command": arm.step.argv, "configured": arm.step.configured, "status": "ok",
            "failure": None, "exit_code": None, "built_by": arm.label,
            "log": str(arm.job.arm_dir / BUILD_LOG), "worktree": str(arm.worktree),
            "reused": False, "cache": None, **fields}  # fmt: skip


def restore(arm: ArmBuild, cache: dict) -> dict | None:
    start = time.perf_counter()
    entry = build_cache.restore(arm.step.cache_dir, cache["key"], arm.worktree)
    if entry is None:
        return None
    wall_s = round(time.perf_counter() - start, 3)
    where = Path(cache["dir"]) / cache["key"]
    (arm.job.arm_dir / BUILD_LOG).write_text(
        f"# not built: {len(entry['files'])} file(s) restored from the build cache {where}, "
        f"built {entry.get('built')} from {entry.get('repo')} in {entry.get('build_wall_s')} s\n"
    )
    say(f"{arm.label}: build of {arm.sha[:10]} restored from the build cache ({where}, "
        f"{wall_s:.1f} s)")  # fmt: skip
    return _outcome(arm, wall_s=wall_s, build_wall_s=entry.get("build_wall_s"),
                    cache={**cache, "hit": True, "stored": False})  # fmt: skip


def run_build(arm: ArmBuild, cache: dict | None) -> dict:
    """Runs the build command; a failure says why from build.log (its compiler error line)."""
    log = arm.job.arm_dir / BUILD_LOG
    say(f"{arm.label}: building {arm.sha[:10]}: {' '.join(arm.step.argv)} (log: {log})")
    result = run_logged(
        arm.step.argv,
        cwd=arm.worktree,
        arm_dir=arm.job.arm_dir,
        log_path=log,
        label=f"{arm.label} build",
        timeout_s=arm.step.timeout_s,
        kill_grace_s=float(arm.cfg.launcher.kill_grace_s),
        env={**arm.env, "PATH": _path(arm)},
        repo=Path(arm.sweep.repo),
    )
    outcome = _outcome(arm, exit_code=result.exit_code, wall_s=result.wall_s,
                       build_wall_s=result.wall_s,
                       cache={**cache, "hit": False} if cache else None)  # fmt: skip
    if result.timed_out:
        why = f"stopped at trainer.build_timeout_s={arm.step.timeout_s:g} s"
    elif result.exit_code != 0:
        line = build_error(log.read_text(errors="replace"))
        why = f"exit code {result.exit_code}" + (f": {line}" if line else "")
    else:
        say(f"{arm.label}: built {arm.sha[:10]} in {result.wall_s:.1f} s")
        return outcome
    return {**outcome, "status": "failed", "failure": f"build failed, {why}; build log: {log}"}


def failure_of(outcome: dict) -> str | None:
    """Why the arm cannot launch after its build, in the words of the arm's record."""
    if outcome["status"] == "ok":
        return None
    if outcome["reused"] and outcome["status"] == "failed":
        return f"the build of this commit failed in {outcome['built_by']}: {outcome['failure']}"
    return outcome["failure"]
