"""The sweep session: what holds for a whole sweep, done once when it starts.

Starting a sweep takes the repository's lock, stops what a dead sweep left running and removes
its worktrees, checks the sweep directory, the tree and every job's prerequisites, resolves
both refs to SHAs, and only then writes: the earlier sweep moved aside, this sweep's state (a
dry run writes and moves nothing).
Under the basic launcher `SweepStart` (a Hydra callback) does it before Hydra writes
multirun.yaml; otherwise the first job does. Later jobs join the sweep (in this process, or in
a process of their own under a launcher that forks).

One `SweepSession` per command holds the locks and the active sweep. `main()` makes it and
serves it (`SweepSession.serving`) while Hydra runs; the Hydra task and `SweepStart`, which
Hydra calls with arguments of its own only, find it with `SweepSession.of_command()`.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from moe_perf.common.errors import REFUSED, PrerequisiteError
from moe_perf.launchers import orphans, preload
from moe_perf.report import sweep as sweeps
from moe_perf.report.record import now_iso
from moe_perf.report.results.files import write_json
from moe_perf.runner import git, outputs, preflight
from moe_perf.runner.hydra_jobs import check_all_jobs, sweep_dir_of
from moe_perf.runner.job import Job, say


def command_entry(command: list) -> str | None:
    """The repository path a trainer command starts from: `-m pkg.mod` imports `pkg` from the
    arm's worktree first (PYTHONPATH), a script runs from it (its cwd); None for neither."""
    parts = [str(part) for part in command or []]
    if len(parts) >= 2 and parts[0] == "-m":
        return parts[1].split(".")[0]
    return parts[0] if parts and not parts[0].startswith("-") else None


def entry_in_commit(repo: Path, sha: str, entry: str) -> bool:
    """Whether the command's entry is in the commit: the script, or the package or module."""
    paths = [entry] if entry.endswith(".py") or "/" in entry else [entry, f"{entry}.py"]
    return any(git.path_in_commit(repo, sha, path) for path in paths)


def trainer_code_note(repo: Path, code_path: str, shas: dict, command: list) -> str | None:
    """What to say when `trainer.code_path` is not at both commits: where it is missing, and
    which trainer code each arm then runs (judged by the command's own entry, since a mistyped
    code_path says nothing about it)."""
    present = {arm: git.path_in_commit(repo, sha, code_path) for arm, sha in shas.items()}
    if all(present.values()):
        return None
    missing = [arm for arm, there in present.items() if not there]
    where = "at neither commit" if len(missing) == len(shas) else f"missing at {', '.join(missing)}"
    commits = ", ".join(f"{arm} {sha[:10]}" for arm, sha in shas.items())
    head = f"trainer.code_path={code_path} is {where} ({commits}) of {repo}"
    entry = command_entry(command)
    own = [arm for arm, sha in shas.items() if entry and entry_in_commit(repo, sha, entry)]
    if len(own) == len(shas):
        return (f"{head}: check the path; `{entry}` is in the repository, so each arm runs its "
                f"own commit's copy")  # fmt: skip
    if not own:
        return (f"{head}: both arms run the same (installed) trainer code; only what the "
                f"repository itself changes can differ")  # fmt: skip
    lack = ", ".join(arm for arm in shas if arm not in own)
    return (f"{head}: {', '.join(own)} runs `{entry}` from its own commit; at {lack} it is not "
            f"in the repository (an installed copy, if any)")  # fmt: skip


def clean_up_dead_sweeps(repo: Path, grace_s: float) -> None:
    """Stops the launches of an earlier sweep on `repo` whose runner died and removes its
    worktrees, saying what was done; refuses (naming the pids) when one cannot be stopped.

    Called with the repository's lock held: no live sweep on it has a launch running.
    """
    found = orphans.launches(repo)
    if found:
        pids = set().union(*found.values())
        shown = orphans.describe_pids(pids)
        left = orphans.stop_pids(pids, grace_s)
        if left:
            listed = " ".join(map(str, sorted(left)))
            raise PrerequisiteError(
                f"an earlier moe_perf sweep on {repo} died and its launch is still running: "
                f"pid(s) {orphans.describe_pids(left)}, which SIGTERM and SIGKILL did not stop "
                f"({orphans.owners_and_states(left)}: another user's process, or one frozen or "
                f"in uninterruptible sleep, state D, which no signal reaches until it is thawed "
                f"or its I/O ends); it would share the devices with this sweep. Stop it as its "
                f"owner (`kill -9 {listed}`; a frozen one once it is thawed) and start the "
                f"sweep again"
            )
        say(f"stopped {len(found)} launch(es) of an earlier moe_perf sweep whose runner died, "
            f"still running and holding the devices: pid(s) {shown}")  # fmt: skip
    stale = git.moe_perf_worktrees(repo)
    for path in stale:
        git.discard_worktree(repo, path)
    if stale:
        say(f"removed {len(stale)} worktree(s) left by an earlier moe_perf sweep whose runner "
            f"died: {', '.join(map(str, stale))}")  # fmt: skip


WORKTREES = "worktrees.json"  # in the sweep's state directory: {"repo", "worktrees": {sha: path}}


def _worktrees_path(sweep_dir: Path) -> Path:
    return Path(sweep_dir) / sweeps.STATE_DIR / WORKTREES


def read_worktrees(sweep_dir: Path) -> dict[str, Path]:
    """{sha: worktree} of the sweep in `sweep_dir` (empty when it made none)."""
    try:
        state = json.loads(_worktrees_path(sweep_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {sha: Path(path) for sha, path in (state.get("worktrees") or {}).items()}


def _write_worktrees(sweep_dir: Path, repo: str, worktrees: dict[str, Path]) -> None:
    path = _worktrees_path(sweep_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"repo": repo, "worktrees": {sha: str(p) for sha, p in worktrees.items()}}
    write_json(path, state)


def end_sweep(sweep_dir: Path) -> None:
    """Removes the worktrees of the sweep in `sweep_dir` (their builds with them). Never
    raises: called on the way out of a sweep, whatever ended it."""
    try:
        state = json.loads(_worktrees_path(sweep_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    for path in map(Path, (state.get("worktrees") or {}).values()):
        if path.name == "worktree" and path.parent.name.startswith(git.WORKTREE_PREFIX):
            git.discard_worktree(state["repo"], path)
    with contextlib.suppress(OSError):
        _worktrees_path(sweep_dir).unlink()


def announce(sweep: sweeps.Sweep, cfg: Any) -> None:
    short = {arm: sha[:10] for arm, sha in sweep.shas.items()}
    say(f"sweep {sweep.sweep_id} in {sweep.repo}")
    refs = sweep.refs
    say(f"base = {refs['base']} @ {short['base']}, feat = {refs['feat']} @ {short['feat']}")
    if sweep.aa_run:
        say(f"A/A run: base and feat are the same commit {short['base']}; "
            f"any difference is run-to-run noise")  # fmt: skip
    notes = [preflight.memory_check_note(cfg)]
    code_path = cfg.trainer.get("code_path")
    if code_path:
        command = list(cfg.trainer.get("command") or [])
        notes.insert(0, trainer_code_note(Path(sweep.repo), code_path, sweep.shas, command))
    for note in filter(None, notes):
        say(note)


# The session of the command running in this context: set by `SweepSession.serving` (main()),
# empty otherwise. A context variable rather than an attribute of the app: nothing is made at
# import, and what `serving` sets it resets.
_SERVED: contextvars.ContextVar[SweepSession | None] = contextvars.ContextVar(
    "moe_perf_sweep_session", default=None
)


@dataclass
class SweepSession:
    """The locks this command holds, the sweep its jobs belong to, and whether its jobs'
    prerequisites were checked when the sweep started (each job is checked once)."""

    locks: dict[str, git.SweepLock] = field(default_factory=dict)
    active: sweeps.Sweep | None = None
    all_jobs_checked: bool = False
    checked_arm_dir: Path | None = None
    _preloader: preload.Preloader | None = None

    @contextlib.contextmanager
    def serving(self) -> Iterator[SweepSession]:
        """This session is the command's while the block runs (`of_command`)."""
        token = _SERVED.set(self)
        try:
            yield self
        finally:
            _SERVED.reset(token)

    @staticmethod
    def of_command() -> SweepSession:
        """The session `main()` serves; where none is served (a job in a process of its own,
        under a launcher that forks), a new one, served for the rest of that process."""
        session = _SERVED.get()
        if session is None:
            session = SweepSession()
            _SERVED.set(session)
        return session

    def has_checked(self, job: Job) -> bool:
        """Whether `job`'s prerequisites were checked when this session started the sweep."""
        return self.all_jobs_checked or self.checked_arm_dir == job.arm_dir

    def _lock(self, repo: Path, sweep_id: str) -> None:
        lock = self.locks.setdefault(str(repo), git.SweepLock(repo))
        try:
            lock.acquire({"sweep_id": sweep_id})
        except git.LockBusy as err:
            raise PrerequisiteError(str(err)) from None

    def sweep_for(self, cfg: Any, job: Job, multirun: DictConfig | None = None) -> sweeps.Sweep:
        """The sweep this job belongs to: started by job 0 (or, for the basic launcher, by
        SweepStart before the first job), joined by the later jobs.

        `multirun`: the sweep's config, when multirun.yaml is not written yet (SweepStart).
        """
        if self.active is not None and Path(self.active.sweep_dir) == job.sweep_dir:
            return self.active
        if job.num > 0 and not is_dry_run(cfg):  # a dry run saved no state: an earlier one's
            state = sweeps.load(job.sweep_dir)
            if state is not None:  # a later job in a process of its own
                self._lock(Path(state.repo), state.sweep_id)
                self.active = state
                return state
        self.active = self.start(cfg, job, multirun)
        return self.active

    def worktree_for(self, sha: str) -> Path:
        """The worktree of commit `sha` for the rest of the active sweep: the one an earlier
        arm made (in this process or another), or a new one when there is none or it is gone
        (a sweep started meanwhile removed it, or it is on another node's disk)."""
        sweep = self.active
        assert sweep is not None, "worktree_for before the sweep started"
        worktrees = read_worktrees(Path(sweep.sweep_dir))
        known = worktrees.get(sha)
        if known is not None and (known / ".git").exists():
            return known
        worktrees[sha] = git.add_worktree(sweep.repo, sha, sha[:10])
        _write_worktrees(Path(sweep.sweep_dir), sweep.repo, worktrees)
        return worktrees[sha]

    def preloader(self, cfg: Any) -> preload.Preloader:
        """The sweep's preloaded interpreter (launcher.preload), stopped by `end`."""
        modules = tuple(str(m) for m in cfg.launcher.preload_modules)
        if self._preloader is not None and self._preloader.modules != modules:
            self._preloader.stop()
            self._preloader = None
        if self._preloader is None:
            self._preloader = preload.Preloader(modules)
            atexit.register(self._preloader.stop)  # however the command ends
        return self._preloader

    def end(self) -> None:
        """The active sweep's worktrees removed (end_sweep) and its preloaded interpreter
        stopped; nothing when there is none."""
        if self._preloader is not None:
            self._preloader.stop()
        if self.active is not None:
            end_sweep(Path(self.active.sweep_dir))

    def start(self, cfg: Any, job: Job, multirun: DictConfig | None = None) -> sweeps.Sweep:
        """Lock, leftovers of dead sweeps, outputs, tree, refs, every job: all checked before
        anything is written; then the earlier sweep is moved aside and this one's state saved."""
        repo = preflight.find_repo(str(cfg.repo), job.cwd)
        sweep_id = sweeps.new_sweep_id()
        self._lock(repo, sweep_id)
        try:
            clean_up_dead_sweeps(repo, float(cfg.launcher.kill_grace_s))
            outputs.check_outputs(repo, job.sweep_dir)
            refs = {"base": cfg.refs.base, "feat": cfg.refs.feat}
            shas = preflight.check_sweep(repo, refs)
            self.check_jobs(cfg, job, repo, multirun)  # before the sweep's state is written
        except BaseException:
            self.locks.pop(str(repo)).release()
            raise
        sweep = sweeps.Sweep(sweep_id, str(job.sweep_dir), str(repo), refs, shas, now_iso())
        if not is_dry_run(cfg):  # a dry run writes nothing and moves nothing
            keep_earlier_sweeps(repo, job.sweep_dir)
            sweeps.save(sweep)
        announce(sweep, cfg)
        return sweep

    def check_jobs(self, cfg: Any, job: Job, repo: Path, multirun: DictConfig | None) -> None:
        """Every job of a multirun whose jobs can be listed; else this job alone."""
        self.all_jobs_checked = check_all_jobs(job, repo, multirun)
        if not self.all_jobs_checked:
            preflight.check_job(cfg, repo)
            self.checked_arm_dir = job.arm_dir


def is_dry_run(cfg: Any) -> bool:
    return bool(OmegaConf.select(cfg, "dry_run", default=False))


def keep_earlier_sweeps(repo: Path, sweep_dir: Path) -> None:
    outputs.ignore_outputs(repo, sweep_dir)
    for earlier, where in outputs.move_earlier_sweeps(sweep_dir).items():
        say(f"kept earlier sweep {earlier} in {where} (its comparison: python -m "
            f"moe_perf.compare {sweep_dir} --sweep {earlier})")  # fmt: skip


BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


class SweepStart(Callback):
    """Starts a multirun's sweep before Hydra's sweeper writes multirun.yaml into the sweep
    directory, so a sweep refused by the lock or a prerequisite writes nothing (exit 2).

    With the basic launcher the jobs run in this process and join the sweep started here.
    Under a launcher that runs each job in a process of its own, the first job starts the
    sweep and takes the lock; here the lock is only tried.
    """

    dry_run_guard: outputs.DryRunGuard | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        hc = config.hydra
        cwd = Path(str(hc.runtime.cwd))
        sweep_dir = sweep_dir_of(hc)
        if is_dry_run(config):  # Hydra's multirun.yaml put back however the command ends
            self.dry_run_guard = outputs.DryRunGuard(sweep_dir)
            atexit.register(self.dry_run_guard.restore)
        job = Job(arm_dir=sweep_dir, sweep_dir=sweep_dir, cwd=cwd, multirun=True,
                  config_name=str(kwargs.get("config_name") or "config"),
                  overrides=list(hc.overrides.task))  # fmt: skip
        try:
            if str(OmegaConf.select(config, "hydra.launcher._target_")) != BASIC_LAUNCHER:
                repo = preflight.find_repo(str(config.repo), cwd)
                git.SweepLock(repo).try_lock()
                return
            SweepSession.of_command().sweep_for(config, job, multirun=config)
        except (PrerequisiteError, git.LockBusy) as err:
            say(f"cannot run: {err}", sys.stderr)
            say("nothing was launched: the sweep is stopped", sys.stderr)
            raise SystemExit(REFUSED) from None

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.dry_run_guard is not None:
            atexit.unregister(self.dry_run_guard.restore)
            self.dry_run_guard.restore()
