"""`dry_run=true`: each arm's exact launch, printed instead of run.

The prerequisites are checked as for a real sweep; checks of this host (devices present) only
warn, so a GPU sweep can be previewed anywhere. The command is built by the same adapter and
launcher calls as a real launch, from the arm's own code: a worktree at the arm's commit exists
for as long as the command is being built (an adapter reads the framework's files there) and is
removed again. Nothing launches, and nothing is written or moved: an earlier sweep's results
stay where they are, and Hydra's multirun.yaml is put back as it was (session.SweepStart).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any

from moe_perf import frameworks, launchers
from moe_perf.common.errors import PrerequisiteError
from moe_perf.frameworks.command import arm_values, fill_env
from moe_perf.launchers.preload import preloaded
from moe_perf.launchers.process import LAUNCH_TOKEN_ENV, trainer_env
from moe_perf.report.sweep import Sweep
from moe_perf.runner import build, build_cache, git
from moe_perf.runner.job import Job, say

WORKTREE = "<worktree>"  # the commit's worktree: a temp directory made for the sweep


def check_host(cfg: Any, dry_run: bool) -> None:
    """The adapter's checks of this host: an error before a real launch, a warning in a dry run."""
    framework = frameworks.get(cfg)
    check = getattr(framework, "check_host", None)
    if check is None:
        return
    try:
        check(cfg)
    except PrerequisiteError as err:
        if not dry_run:
            raise
        say(f"warning (dry run; a real run stops here): {err}", sys.stderr)


def added_env(launch_env: dict[str, str], worktree: Path, arm_dir: Path) -> dict[str, str]:
    """What the arm's environment adds to or changes in the runner's, worktree shown as such."""
    full = trainer_env(worktree, arm_dir, "<launch id>", launch_env)
    added = {k: v for k, v in full.items() if os.environ.get(k) != v}
    return {k: v.replace(str(worktree), WORKTREE) for k, v in sorted(added.items())}


def build_cache_words(cfg: Any) -> str:
    root = build_cache.cache_root(cfg.trainer.get("build_cache", "off"))
    return f"build cache {root}" if root else "no build cache"


def preview_arm(cfg: Any, job: Job, sweep: Sweep, label: str) -> dict:
    """The arm's command line, working directory and added environment; also printed."""
    arm = str(cfg.arm.name)
    config_path = job.arm_dir / "config.yaml"
    with git.worktree(sweep.repo, sweep.shas[arm], f"dryrun-{label}") as worktree:
        trainer = frameworks.get(cfg).launch(cfg, job.arm_dir, config_path, worktree)
        launcher = launchers.get(cfg)
        argv = launcher.argv(cfg, job.arm_dir, trainer.argv)
        values = arm_values(cfg, job.arm_dir, config_path, worktree)
        arm_env = fill_env(trainer.env, cfg, values)
        env = added_env({**launcher.env(cfg), **arm_env}, worktree, job.arm_dir)
        argv = [part.replace(str(worktree), WORKTREE) for part in argv]
        build_argv = None
        if build.configured_build(cfg):
            step = build.build_step(cfg, job.arm_dir, worktree, label, launcher)
            build_argv = [part.replace(str(worktree), WORKTREE) for part in step.argv]
    env[LAUNCH_TOKEN_ENV] = "<launch id>"
    plan = {
        "arm": label,
        "argv": argv,
        "cwd": f"{WORKTREE} (a detached worktree of {sweep.repo} at {sweep.shas[arm][:10]})",
        "env": env,
        "log_format": trainer.log_format,
        "build": build_argv,
        "preload": preloaded(cfg, launcher, trainer.argv, job.multirun, job.total),
    }
    say(f"{label}: dry run, nothing launched ({cfg.model.name} {cfg.tag})")
    say(f"{label}: cwd {plan['cwd']}")
    say(f"{label}: env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()))
    if build_argv is not None:
        say(f"{label}: build (in {WORKTREE}, before the first arm of {sweep.shas[arm][:10]}, "
            f"then reused; log {job.arm_dir / build.BUILD_LOG}; "
            f"{build_cache_words(cfg)}): {shlex.join(build_argv)}")  # fmt: skip
    say(f"{label}: command {shlex.join(argv)}")
    if plan["preload"]:
        modules = ", ".join(map(str, cfg.launcher.preload_modules))
        say(f"{label}: launcher.preload: run as a fork of the sweep's interpreter that imported "
            f"{modules} once, or as this command where it cannot serve the arm")  # fmt: skip
    say(f"{label}: {config_path} is written when the sweep runs; a dry run writes nothing "
        f"(`--cfg job --resolve` shows the composed config)")  # fmt: skip
    say(f"{label}: the trainer's lines are read as {trainer.log_format}")
    return plan
