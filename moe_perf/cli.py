"""The command: `python -m moe_perf [overrides] [-m arm=base,feat ...]`, one Hydra job per arm.

`main` is a thin Hydra shell; `run_arm(cfg)` does the work and is importable. The first job of
a sweep does what holds for the whole sweep (lock, clean tree, refs -> SHAs, every job's
prerequisites) before any arm launches; a failed prerequisite stops the command with a short
message and exit code 2. A failed arm is recorded and the sweep goes on (a job that raised
would make Hydra skip the comparison at the end); Ctrl-C stops the sweep.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from moe_perf import gitops, launch, records, validate
from moe_perf import sweep as sweeps
from moe_perf.schema import repeat_suffix
from moe_perf.slurm import register_hydra_launcher
from moe_perf.validate import PrerequisiteError

register_hydra_launcher()  # hydra/launcher=moe_perf_slurm (issue 5): see moe_perf/slurm.py

SWEEP_DIR = Path("outputs/validate-performance")


@dataclass
class Job:
    """Where one Hydra job (one arm) runs and writes."""

    arm_dir: Path
    sweep_dir: Path
    cwd: Path
    num: int = 0
    multirun: bool = False
    config_name: str = "config"
    overrides: list[str] = field(default_factory=list)


def current_job() -> Job:
    hc = HydraConfig.get()
    cwd = Path(hc.runtime.cwd)
    sweep_dir = Path(str(hc.sweep.dir))
    return Job(
        arm_dir=Path(hc.runtime.output_dir),
        sweep_dir=sweep_dir if sweep_dir.is_absolute() else cwd / sweep_dir,
        cwd=cwd,
        num=int(OmegaConf.select(hc, "job.num", default=0) or 0),
        multirun=hc.mode == RunMode.MULTIRUN,
        config_name=str(hc.job.config_name),
        overrides=list(hc.overrides.task),
    )


def standalone_job(cfg: DictConfig) -> Job:
    """The layout the command uses, for callers of run_arm outside Hydra."""
    cwd = Path.cwd()
    name = f"{cfg.tag}-{cfg.arm.name}{repeat_suffix(cfg.repeat)}"
    return Job(arm_dir=cwd / SWEEP_DIR / cfg.model.name / name, sweep_dir=cwd / SWEEP_DIR, cwd=cwd)


def say(text: str, stream=None) -> None:
    print(f"[moe_perf] {text}", file=stream or sys.stdout, flush=True)


# ---- the sweep -------------------------------------------------------------------------------

_LOCKS: dict[str, gitops.SweepLock] = {}
_ACTIVE: sweeps.Sweep | None = None


def _lock(repo: Path, sweep_id: str) -> None:
    lock = _LOCKS.setdefault(str(repo), gitops.SweepLock(repo))
    try:
        lock.acquire({"sweep_id": sweep_id})
    except gitops.LockBusy as err:
        raise PrerequisiteError(str(err)) from None


def ignore_outputs(repo: Path, sweep_dir: Path) -> None:
    """Outputs inside the repository must not dirty its tree for the next sweep."""
    try:
        rel = sweep_dir.resolve().relative_to(repo)
    except ValueError:
        return  # outside the repository
    if not rel.parts or gitops.is_ignored(repo, rel / "metrics.json"):
        return
    root = repo / rel.parts[0]
    target = root / ".gitignore" if not (root / ".gitignore").exists() else sweep_dir / ".gitignore"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("# written by moe_perf: run outputs are not source\n*\n")


def sweep_job_overrides(job: Job) -> list[list[str]] | None:
    """Every job's overrides, expanded as the basic sweeper does (None: cannot tell)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        multirun = OmegaConf.load(job.sweep_dir / "multirun.yaml")
    except OSError:
        return None
    if "BasicSweeper" not in str(OmegaConf.select(multirun, "hydra.sweeper._target_")):
        return None
    params = OmegaConf.select(multirun, "hydra.sweeper.params") or {}
    arguments = [f"{k}={v}" for k, v in params.items()] + list(multirun.hydra.overrides.task)
    parsed = OverridesParser.create().parse_overrides(arguments)
    return [list(j) for batch in BasicSweeper.split_arguments(parsed, None) for j in batch]


def check_all_jobs(job: Job, repo: Path) -> bool:
    """Every job's prerequisites, before the first arm launches (multirun only).

    False when the sweep's jobs cannot be listed (a sweeper other than the basic one).
    """
    from hydra.core.global_hydra import GlobalHydra

    all_overrides = sweep_job_overrides(job)
    if all_overrides is None or not GlobalHydra.instance().is_initialized():
        return False  # the job checks itself
    problems = []
    for overrides in all_overrides:
        try:
            job_cfg = hydra.compose(config_name=job.config_name, overrides=overrides)
            validate.check_job(job_cfg, repo)
        except PrerequisiteError as err:
            problems.append(f"job [{' '.join(overrides)}]: {err}")
        except Exception as err:  # a value that does not compose: Hydra's own message
            problems.append(f"job [{' '.join(overrides)}]: {type(err).__name__}: {err}")
    if problems:
        raise PrerequisiteError(f"{len(problems)} job(s) of this sweep cannot run:\n  " +
                                "\n  ".join(problems))  # fmt: skip
    return True


def trainer_code_note(repo: Path, code_path: str, shas: dict) -> str | None:
    present = {arm: gitops.path_in_commit(repo, sha, code_path) for arm, sha in shas.items()}
    if all(present.values()):
        return None
    if not any(present.values()):
        return (
            f"trainer.code_path={code_path} is not in {repo}: both arms run the same (installed) "
            f"trainer code; only what the repository itself changes can differ"
        )
    missing = ", ".join(arm for arm, there in present.items() if not there)
    return f"trainer.code_path={code_path} is missing at {missing}: it runs the installed trainer"


def start_sweep(cfg: DictConfig, job: Job) -> sweeps.Sweep:
    repo = validate.find_repo(str(cfg.repo), job.cwd)
    sweep_id = sweeps.new_sweep_id()
    ignore_outputs(repo, job.sweep_dir)
    _lock(repo, sweep_id)
    try:
        refs = {"base": cfg.refs.base, "feat": cfg.refs.feat}
        shas = validate.check_sweep(repo, refs)
        if not (job.multirun and check_all_jobs(job, repo)):
            validate.check_job(cfg, repo)  # before the sweep's state is written
    except BaseException:
        _LOCKS.pop(str(repo)).release()
        raise
    sweep = sweeps.Sweep(sweep_id, str(job.sweep_dir), str(repo), refs, shas, records.now_iso())
    sweeps.save(sweep)
    announce(sweep, str(cfg.trainer.code_path))
    return sweep


def announce(sweep: sweeps.Sweep, code_path: str) -> None:
    short = {arm: sha[:10] for arm, sha in sweep.shas.items()}
    say(f"sweep {sweep.sweep_id} in {sweep.repo}")
    refs = sweep.refs
    say(f"base = {refs['base']} @ {short['base']}, feat = {refs['feat']} @ {short['feat']}")
    if sweep.aa_run:
        say(f"A/A run: base and feat are the same commit {short['base']}; "
            f"any difference is run-to-run noise")  # fmt: skip
    note = trainer_code_note(Path(sweep.repo), code_path, sweep.shas)
    if note:
        say(note)


def sweep_for(cfg: DictConfig, job: Job) -> sweeps.Sweep:
    """The sweep this job belongs to: started by job 0, joined by the later jobs."""
    global _ACTIVE
    if job.num > 0:
        if _ACTIVE is not None and Path(_ACTIVE.sweep_dir) == job.sweep_dir:
            return _ACTIVE
        state = sweeps.load(job.sweep_dir)
        if state is not None:  # a later job in a process of its own
            _lock(Path(state.repo), state.sweep_id)
            _ACTIVE = state
            return state
    _ACTIVE = start_sweep(cfg, job)
    return _ACTIVE


# ---- one arm ---------------------------------------------------------------------------------


def arm_config(cfg: DictConfig, sweep: sweeps.Sweep) -> dict:
    """The resolved config the trainer reads: the sweep's refs, absolute paths, no `hydra`."""
    node = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    node.refs.base, node.refs.feat = sweep.refs["base"], sweep.refs["feat"]
    node.repo = sweep.repo
    node.data.root = str(validate.corpus_root(cfg, Path(sweep.repo)))
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


def launch_arm(cfg: DictConfig, job: Job, sweep: sweeps.Sweep, label: str) -> launch.LaunchResult:
    arm = str(cfg.arm.name)
    config_path = job.arm_dir / "config.yaml"
    with gitops.worktree(sweep.repo, sweep.shas[arm], label) as worktree:
        argv = launch.launcher_argv(cfg, job.arm_dir, config_path)
        return launch.run_trainer(
            argv,
            cwd=worktree,
            arm_dir=job.arm_dir,
            label=label,
            timeout_s=float(cfg.timeout_s),
            kill_grace_s=float(cfg.launcher.get("kill_grace_s", 10)),
            max_steps=int(cfg.training.max_steps),
        )


def finish_arm(job, sweep, config, result, started, t0, extra) -> dict:
    arm = config["arm"]["name"]
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
        extra=extra,
    )
    records.write_record(job.arm_dir / "metrics.json", record)
    return record


def report(record: dict, label: str) -> None:
    if record["status"] == "ok":
        s = record["summary"]
        say(f"{label}: ok, median step {s['step_time_s']:.4f} s, {s['tokens_per_s']:,.0f} "
            f"tokens/s, peak {s['peak_mem_gib']:.2f} GiB ({s['steps_measured']} steps measured, "
            f"step 1 dropped)")  # fmt: skip
    else:
        say(f"{label}: FAILED: {record['failure']} (log: {record['log']})", sys.stderr)


def run_checked_arm(cfg: DictConfig, job: Job, sweep: sweeps.Sweep) -> dict:
    label = f"{cfg.arm.name}{repeat_suffix(cfg.repeat, job.overrides)}"
    config = arm_config(cfg, sweep)
    moved = sweeps.move_aside(job.arm_dir)
    if moved:
        say(f"kept the earlier run of {job.arm_dir.name} in {moved}")
    job.arm_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(config), job.arm_dir / "config.yaml")
    started, t0 = records.now_iso(), time.perf_counter()
    extra = {"overrides": job.overrides, "repo": sweep.repo}
    mismatch = sweeps.check_identity(sweep, config["model"]["name"], config["tag"], label, config)
    if mismatch:
        (job.arm_dir / "console.log").write_text(f"not launched: {mismatch}\n")
        result = launch.LaunchResult(exit_code=None, failure=mismatch)
    else:
        say(f"{label}: {sweep.refs[cfg.arm.name]} @ {sweep.shas[cfg.arm.name][:10]}, "
            f"{cfg.model.name} {cfg.tag} -> {job.arm_dir}")  # fmt: skip
        try:
            result = launch_arm(cfg, job, sweep, label)
        except KeyboardInterrupt:
            stopped = launch.LaunchResult(exit_code=None, failure="interrupted (Ctrl-C/SIGTERM)")
            report(finish_arm(job, sweep, config, stopped, started, t0, extra), label)
            raise
    record = finish_arm(job, sweep, config, result, started, t0, extra)
    report(record, label)
    log_to_wandb(record, job.arm_dir, cfg)
    return record


def log_to_wandb(record: dict, arm_dir: Path, cfg: DictConfig) -> None:
    # after the trainer exited and the record is on disk: never inside the timed region
    if str(cfg.wandb.mode) == "disabled":
        return
    from moe_perf.wandb_log import log_arm

    log_arm(record, arm_dir, OmegaConf.to_container(cfg.wandb, resolve=True))


def run_arm(cfg: DictConfig, job: Job | None = None) -> dict:
    """Runs one arm (one Hydra job) and returns its record (also written to metrics.json).

    Raises SystemExit(2) with a printed message when a prerequisite fails (nothing launched,
    no arm directory left), KeyboardInterrupt when interrupted (processes and worktree gone).
    """
    job = job or standalone_job(cfg)
    try:
        sweep = sweep_for(cfg, job)
        validate.check_job(cfg, Path(sweep.repo))
    except PrerequisiteError as err:
        sweeps.remove_empty_dirs(job.arm_dir, stop=job.sweep_dir.parent)
        say(f"cannot run: {err}", sys.stderr)
        say("nothing was launched" + (": the sweep is stopped" if job.multirun else ""), sys.stderr)
        raise SystemExit(2) from None
    with sigterm_as_interrupt():
        return run_checked_arm(cfg, job, sweep)


def config_dir() -> str:
    """The configs of the moe_perf that is running: `conf/` of its source tree when it runs
    from one (a checkout on PYTHONPATH, an editable install), else the installed package's
    `moe_perf.conf`. Resolving `pkg://moe_perf.conf` alone would fail without an install, and
    with an editable install elsewhere it would mix that tree's configs with this code."""
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file() and (root / "conf" / "config.yaml").is_file():
        return str(root / "conf")
    return "pkg://moe_perf.conf"


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def hydra_main(cfg: DictConfig) -> None:
    run_arm(cfg, current_job())


def flags_first(argv: list[str]) -> list[str]:
    """`model=x -m arm=base,feat` as users type it: Hydra's parser wants -m before overrides."""
    flags = [arg for arg in argv if arg in ("-m", "--multirun")]
    return flags + [arg for arg in argv if arg not in ("-m", "--multirun")]


def main() -> None:
    """The `moe-perf` console script and `python -m moe_perf`."""
    sys.argv[1:] = flags_first(sys.argv[1:])
    try:
        hydra_main()
    except KeyboardInterrupt:
        say("interrupted: the running arm was stopped and its worktree removed; the sweep "
            "stopped there", sys.stderr)  # fmt: skip
        sys.exit(130)
