"""One arm: its resolved config, its worktree, its launch, its record.

`run_arm(cfg, job, session)` is what one Hydra job does; it is importable and takes the
composed config. A failed arm is recorded and returned (a job that raised would make Hydra
skip the comparison at the end); Ctrl-C and SIGTERM stop the arm and are re-raised.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from moe_perf import frameworks, launchers
from moe_perf.common.errors import REFUSED, PrerequisiteError
from moe_perf.common.explain import explain_steps
from moe_perf.frameworks.command import arm_values, fill_env
from moe_perf.launchers import preload
from moe_perf.launchers.process import LaunchResult, run_trainer, trainer_env
from moe_perf.logs import RunShape
from moe_perf.logs.progress import shown
from moe_perf.report import record as records
from moe_perf.report.results.arm import ArmRecord, Summary
from moe_perf.report.sweep import Sweep
from moe_perf.runner import (
    build,
    build_isolation,
    compile_cache,
    dryrun,
    outputs,
    preflight,
    verify_imports,
)
from moe_perf.runner.job import Job, repeat_suffix, say, standalone_job
from moe_perf.runner.progress import RankThreads, arm_count, starting_line
from moe_perf.runner.session import SweepSession


def arm_config(cfg: DictConfig, sweep: Sweep) -> dict:
    """The resolved config the trainer reads: the sweep's refs, absolute paths, no `hydra`."""
    node = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    node.refs.base, node.refs.feat = sweep.refs["base"], sweep.refs["feat"]
    node.repo = sweep.repo
    node.data.root = str(preflight.corpus_root(cfg, Path(sweep.repo)))
    if explain_steps(cfg):  # the profiled steps after the measured ones
        node.trainer.explain_steps = explain_steps(cfg)
    return OmegaConf.to_container(node, resolve=True)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM stops an arm as Ctrl-C does: processes stopped, worktree removed, sweep ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def removed_after(path: Path | None):
    """`path` (a worktree's bytecode in the compile cache) removed on the way out."""
    try:
        yield
    finally:
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)


def build_before_launch(cfg: DictConfig, job: Job, sweep: Sweep, label: str, worktree: Path,
                        env: dict[str, str], extra: dict) -> str | None:  # fmt: skip
    """trainer.build for this arm's commit, once per commit (runner/build.py); notes the
    outcome in `extra` and returns why the arm cannot launch, if it cannot."""
    if not build.configured_build(cfg):
        return None
    launcher = launchers.get(cfg)
    step = build.build_step(cfg, job.arm_dir, worktree, label, launcher)
    extra["build"] = {"command": step.argv, "status": "interrupted"}  # until it has ended
    arm = build.ArmBuild(cfg, job, sweep, label, sweep.shas[str(cfg.arm.name)], worktree, env,
                         step)  # fmt: skip
    try:
        extra["build"] = build.ensure_built(arm)
    except KeyboardInterrupt:
        (job.arm_dir / "console.log").write_text("not launched: interrupted during the build\n")
        raise
    except build_isolation.SnapshotError as err:
        extra["build"] = {"command": step.argv, "status": "failed", "failure": str(err)}
        return str(err)
    return build.failure_of(extra["build"])


def note_imports(cfg: DictConfig, job: Job, sweep: Sweep, label: str, worktree: Path,
                 env: dict[str, str], extra: dict) -> None:  # fmt: skip
    """The record's `imports`: what the arm will load (runner/verify_imports.py), and a
    warning for each listed module that is the shared environment's copy."""
    full = trainer_env(worktree, job.arm_dir, "imports", env, Path(sweep.repo))
    extra["imports"] = verify_imports.probe(cfg, worktree, full)
    for warning in verify_imports.warnings(extra["imports"]):
        say(f"{label}: warning: {warning}", sys.stderr)


def launch_arm(cfg: DictConfig, job: Job, sweep: Sweep, session: SweepSession, label: str,
               extra: dict) -> LaunchResult:  # fmt: skip
    """Builds (once per commit) and runs the arm's trainer in its commit's worktree; notes in
    `extra` the build, what the arm imports and which compile cache it used."""
    arm = str(cfg.arm.name)
    config_path = job.arm_dir / "config.yaml"
    launcher = launchers.get(cfg)
    threads = RankThreads.for_launch(int(cfg.mesh.nproc_per_node))
    worktree = session.worktree_for(sweep.shas[arm])
    trainer = frameworks.get(cfg).launch(cfg, job.arm_dir, config_path, worktree)
    values = arm_values(cfg, job.arm_dir, config_path, worktree)
    # every trainer's processes get torch.compile's caches and the bytecode directory
    # (compile_cache.py) under the adapter's environment, the user's trainer.env winning
    env = compile_cache.under(cfg, worktree, fill_env(trainer.env, cfg, values))
    forked = preload.preloaded(cfg, launcher, trainer.argv, job.multirun, job.total)
    if forked:  # the server imports while the arm is prepared (its build, its imports noted)
        added = {**threads.env, **launcher.env(cfg), **env}
        session.preloader(cfg).warm(worktree, job.arm_dir, added, Path(sweep.repo))
    not_built = build_before_launch(cfg, job, sweep, label, worktree, env, extra)
    if not_built:
        (job.arm_dir / "console.log").write_text(f"not launched: {not_built}\n")
        return LaunchResult(exit_code=None, failure=not_built)
    note_imports(cfg, job, sweep, label, worktree, env, extra)
    # as the trainer gets it: that environment's, else the runner's, else None (torch's
    # default under /tmp)
    inductor_dir = env.get("TORCHINDUCTOR_CACHE_DIR") or os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    extra["compile_cache"] = {"dir": str(Path(inductor_dir).parent) if inductor_dir else None,
                              "inductor_dir": inductor_dir}  # fmt: skip
    one_process = launcher.one_process(cfg)
    compiled = bool(cfg.trainer.get("compile", False))
    say(starting_line(label, threads, compiled, torchrun=not one_process))
    # the worktree's own bytecode, when the compile cache holds it (git.add_worktree: the
    # worktree's temporary directory holds it)
    bytecode = compile_cache.bytecode_dir_of(env, worktree.parent)
    env = {**threads.env, **launcher.env(cfg), **env}
    argv = launcher.argv(cfg, job.arm_dir, trainer.argv)
    if forked:
        argv = session.preloader(cfg).argv(argv, worktree, job.arm_dir, env, Path(sweep.repo))
    with removed_after(bytecode), compile_cache.bytecode_compiled(env):
        return run_trainer(
            argv,
            cwd=worktree,
            arm_dir=job.arm_dir,
            label=label,
            timeout_s=float(cfg.timeout_s),
            kill_grace_s=float(cfg.launcher.kill_grace_s),
            max_steps=int(cfg.training.max_steps),
            env=env,
            failure_reason=launcher.failure_reason,
            one_process=one_process,
            log_format=trainer.log_format,
            shape=RunShape.of_config(cfg),
            repo=Path(sweep.repo),
        )


def finish_arm(job: Job, sweep: Sweep, config: dict, result: LaunchResult, started: str,
               t0: float, extra: dict) -> ArmRecord:  # fmt: skip
    arm = config["arm"]["name"]
    startup = compile_cache.read_startup(job.arm_dir)  # rank 0's timeline and cache counters
    preloaded_by = preload.read_info(job.arm_dir)  # launcher.preload: served, or why not
    if preloaded_by is not None:
        extra = {**extra, "preload": preloaded_by}
    if startup is not None:
        extra = {**extra, "startup_marks_s": startup.get("marks_s")}
        if startup.get("compile_phases_s"):  # where the compiles' time went (reference trainer)
            extra["startup_compile"] = {
                "phases_s": startup["compile_phases_s"],
                "triton_in_process": startup.get("triton_in_process"),
            }
        if "compile_cache" in extra:
            counters = startup.get("compile_counters") or None
            extra["compile_cache"] = {**extra["compile_cache"], "counters": counters}
    record = records.arm_record(
        config=config,
        sweep_id=sweep.sweep_id,
        arm_dir=job.arm_dir,
        sha=sweep.shas[arm],
        exit_code=result.exit_code,
        failure=result.failure,
        steps=result.steps,
        trainer_env=result.trainer_env,
        started=started,
        wall_time_s=time.perf_counter() - t0,
        trainer_wall_s=result.trainer_wall_s,
        extra={
            **extra,
            "launch_exit_code": result.launch_exit_code,
            "log_format": result.log_format,
            "derivations": result.derivations,
        },
    )
    record.dump(job.arm_dir / "metrics.json")
    return record


def report(record: ArmRecord, label: str) -> None:
    if record.ok:
        s = record.summary
        say(f"{label}: ok, median step {shown(s.step_time_s, '.4f')} s, "
            f"{shown(s.tokens_per_s, ',.0f')} tokens/s, peak "
            f"{shown(s.peak_mem_gib, '.2f')} GiB ({s.steps_measured} steps measured, "
            f"step 1{_settling_words(s)} dropped)")  # fmt: skip
        if not s.settled:
            say(f"{label}: warning: {s.settling}", sys.stderr)
        compiled = record.extra.get("compile_cache")
        if compiled and record.section("trainer", "compile"):
            say(f"{label}: {compile_cache.describe(compiled)}")
    else:
        say(f"{label}: FAILED: {record.failure} (log: {record.log})", sys.stderr)


def _settling_words(summary: Summary) -> str:
    settling = summary.steps_settling
    return f" and {settling} settling step{'s' if settling > 1 else ''}" if settling else ""


def log_to_wandb(record: ArmRecord, arm_dir: Path, cfg: DictConfig) -> None:
    # after the trainer exited and the record is on disk: never inside the timed region
    if str(cfg.wandb.mode) == "disabled":
        return
    from moe_perf.runner.wandb_log import log_arm  # wandb is imported only when it is used

    log_arm(record.to_dict(), arm_dir, OmegaConf.to_container(cfg.wandb, resolve=True))


def run_checked_arm(cfg: DictConfig, job: Job, sweep: Sweep,
                    session: SweepSession) -> ArmRecord:  # fmt: skip
    label = f"{cfg.arm.name}{repeat_suffix(cfg.repeat, job.overrides)}"
    config = arm_config(cfg, sweep)
    moved = outputs.move_aside(job.arm_dir, job.sweep_dir)
    if moved:
        say(f"kept the earlier run of {job.arm_dir.name} in {moved}")
    job.arm_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(config), job.arm_dir / "config.yaml")
    started, t0 = records.now_iso(), time.perf_counter()
    extra = {"overrides": job.overrides, "repo": sweep.repo}
    mismatch = outputs.check_identity(sweep, config["model"]["name"], config["tag"], label, config)
    if mismatch:
        (job.arm_dir / "console.log").write_text(f"not launched: {mismatch}\n")
        result = LaunchResult(exit_code=None, failure=mismatch)
    else:
        arm = cfg.arm.name
        say(f"{arm_count(job.num, job.total)}: {label}: {sweep.refs[arm]} @ "
            f"{sweep.shas[arm][:10]}, {cfg.model.name} {cfg.tag} -> {job.arm_dir}")  # fmt: skip
        try:
            result = launch_arm(cfg, job, sweep, session, label, extra)
        except KeyboardInterrupt:
            stopped = LaunchResult(exit_code=None, failure="interrupted (Ctrl-C/SIGTERM)")
            report(finish_arm(job, sweep, config, stopped, started, t0, extra), label)
            raise
    record = finish_arm(job, sweep, config, result, started, t0, extra)
    report(record, label)
    log_to_wandb(record, job.arm_dir, cfg)
    return record


def run_arm(cfg: Any, job: Job | None = None,
            session: SweepSession | None = None) -> ArmRecord | dict:  # fmt: skip
    """Runs one arm (one Hydra job) and returns its record (also written to metrics.json).

    Raises SystemExit(2) with a printed message when a prerequisite fails (nothing launched,
    no arm directory left), KeyboardInterrupt when interrupted (processes and the sweep's
    worktrees gone).
    With `dry_run=true` it returns the arm's launch plan instead (nothing launched or written).
    """
    job = job or standalone_job(cfg)
    session = session or SweepSession()
    dry_run = bool(cfg.get("dry_run", False))
    try:
        preflight.check_config(cfg)  # before the sweep takes a lock or writes anything
        sweep = session.sweep_for(cfg, job)
        if not session.has_checked(job):  # a job that joined a sweep started before it
            preflight.check_job(cfg, Path(sweep.repo))
        dryrun.check_host(cfg, dry_run)
    except PrerequisiteError as err:
        outputs.remove_empty_dirs(job.arm_dir, stop=job.sweep_dir.parent)
        say(f"cannot run: {err}", sys.stderr)
        say("nothing was launched" + (": the sweep is stopped" if job.multirun else ""), sys.stderr)
        session.end()  # the worktrees of the sweep's earlier arms, if any
        raise SystemExit(REFUSED) from None
    if dry_run:
        label = f"{cfg.arm.name}{repeat_suffix(cfg.repeat, job.overrides)}"
        try:
            return dryrun.preview_arm(cfg, job, sweep, label)
        finally:
            outputs.remove_empty_dirs(job.arm_dir, stop=job.sweep_dir.parent)
    # A commit's worktree (and its build) serves every arm of the commit until the sweep ends:
    # at the end of a multirun (callback.py), after a single run's one arm, or when an arm is
    # interrupted or raises (the sweep stops there)
    ended = True
    with sigterm_as_interrupt():
        try:
            record = run_checked_arm(cfg, job, sweep, session)
            ended = not job.multirun
            return record
        finally:
            if ended:
                session.end()
