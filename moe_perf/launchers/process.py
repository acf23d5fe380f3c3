"""Run one arm's launch: stream and save its output, the timeout, and stop every process it
started (Ctrl-C, SIGTERM, timeout: launchers/stopping.py). The same for every launcher: a
launcher only builds the argument list (launchers/local.py, launchers/slurm.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from moe_perf.launchers.failures import LaunchFailure, describe, read_failure
from moe_perf.launchers.orphans import LAUNCH_REPO_ENV, LAUNCH_TOKEN_ENV
from moe_perf.launchers.stopping import stop_launch
from moe_perf.logs import LogReader, ParsedLog, RunShape, TeeLines
from moe_perf.logs.progress import StepProgress, UnmatchedLines

# torchrun --tee prefixes every worker line with its rank: "[rank0]:" (trainer_env asks for the
# global rank) or, by default, the local one: "[default0]:".
_RANK_PREFIX_RE = re.compile(r"^\[(?:default|rank)(\d+)\]:")
# Lines that tell a person watching nothing (console.log keeps them): kineto's marker of every
# profiler start and stop, `USDT:<time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52]
# profiler_start`, printed at a log level above its errors' (KINETO_LOG_LEVEL would hide both).
_CONSOLE_NOISE_RE = re.compile(r"^USDT:.*\] profiler_(?:start|stop)\s*$")


@dataclass
class LaunchResult:
    exit_code: int | None
    failure: str | None
    steps: list[dict] = field(default_factory=list)
    trainer_env: dict | None = None
    trainer_wall_s: float = 0.0
    log_format: str = "contract"
    derivations: list[str] = field(default_factory=list)  # what was derived, in words
    launch_exit_code: int | None = None  # the launcher's own (torchrun's, srun's) exit status
    timed_out: bool = False  # stopped at timeout_s


def trainer_env(worktree: Path, arm_dir: Path, token: str, extra: dict[str, str] | None = None,
                repo: Path | None = None) -> dict[str, str]:  # fmt: skip
    env = dict(os.environ)
    env.update({k: v for k, v in (extra or {}).items() if k != "PYTHONPATH"})
    # the worktree first, so an arm whose repository holds the trainer runs its own code; then
    # what the trainer's env adds (a per-arm build prefix), then the runner's own
    paths = (str(worktree), (extra or {}).get("PYTHONPATH"), os.environ.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["MOE_PERF_ARM_DIR"] = str(arm_dir)
    env["PYTHONUNBUFFERED"] = "1"  # lines reach the console as the step ends, not at exit
    # torchrun's --tee prefix with the global rank, where its default has the local one: on
    # two nodes both would print `[default0]:`, and where every rank logs its steps
    # (torchtitan) one rank's line could not be told from another's (ignored by torchrun < 2.2)
    env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = "[rank${rank}]:"
    # every process of the launch carries these: leftovers are found even after torchrun (its
    # workers run in sessions of their own) or the runner itself is gone (orphans.py)
    env[LAUNCH_TOKEN_ENV] = token
    if repo is not None:
        env[LAUNCH_REPO_ENV] = str(Path(repo).resolve())
    return env


# ---- output ----------------------------------------------------------------------------------


class _Pump:
    """Reads the launch's output: all of it to console.log, rank 0 (and torchrun) to the
    console with the arm's label, every rank's lines to the reader of the trainer's format,
    a progress line per step in place of the step lines. One thread per stream: torchrun tees
    each rank's stdout and stderr under the same prefix, so in one pipe a rank's stderr line
    glued onto a half of its stdout line could not be told from the half's own rest."""

    def __init__(self, streams: list[TextIO], log: TextIO, label: str, echo: TextIO,
                 reader: LogReader, max_steps: int):  # fmt: skip
        self.log, self.label, self.echo = log, label, echo
        self.reader, self.max_steps = reader, max_steps
        self.progress = StepProgress(label, max_steps)  # elapsed and ETA per step line
        self.unmatched = UnmatchedLines(reader.log_format)  # a format that reads no step
        self.quiet = False  # stopping: torchrun's words about the signal go to console.log only
        self._lock = threading.Lock()  # one line at a time into console.log and the reader
        self.threads = [
            threading.Thread(target=self._run, args=(s,), name=f"pump-{label}", daemon=True)
            for s in streams
        ]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self, stream: TextIO) -> None:
        tee = TeeLines()  # a rank's line torchrun passed on in two pieces is one line again
        for line in stream:
            with self._lock:
                self.log.write(line)  # as torchrun printed it
                self.log.flush()
                for whole in tee.split(line):
                    self._handle(whole)
        with self._lock:
            for piece in tee.rest():
                self._handle(piece)

    def _handle(self, line: str) -> None:
        sample = self.reader.feed(line)
        if self.quiet:
            return
        warning = self.unmatched.feed(line, self.reader.step_line)
        if warning:
            self._print(f"[moe_perf] {self.label}: warning: {warning}")
        if sample is not None:
            self._print(self.progress.line(sample))
            return
        if self.reader.step_line:
            return  # another rank's line of a step already shown
        match = _RANK_PREFIX_RE.match(line)
        if match and match.group(1) != "0":
            return  # other ranks: console.log and torchrun/ only
        text = line[match.end() :] if match else line
        if not _CONSOLE_NOISE_RE.match(text):
            self._print(f"[{self.label}] {text}")

    def _print(self, text: str) -> None:
        self.echo.write(text + "\n")
        self.echo.flush()


def failure_of(exit_code: int | None, timed_out: bool, timeout_s: float, parsed: ParsedLog,
               max_steps: int, launch: LaunchFailure) -> str | None:  # fmt: skip
    if timed_out:
        return f"timed out after {timeout_s:g} s (timeout_s) and was stopped"
    if exit_code != 0:
        return describe(exit_code, launch)
    return parsed.failure(max_steps)


def run_trainer(
    argv: list[str],
    *,
    cwd: Path,
    arm_dir: Path,
    label: str,
    timeout_s: float,
    kill_grace_s: float,
    max_steps: int,
    env: dict[str, str] | None = None,
    failure_reason: Callable[[int | None, str], str | None] | None = None,
    echo: TextIO | None = None,
    log_format: str = "contract",
    shape: RunShape | None = None,
    repo: Path | None = None,
    one_process: bool = False,
) -> LaunchResult:
    """Run one arm's launch to the end, saving its output in `<arm_dir>/console.log`.

    `env` is added to the runner's environment; `failure_reason(exit_code, console_tail)` is
    the launcher's reading of a failed launch; `log_format` is how the trainer prints its
    steps (moe_perf/logs) and `shape` lets its figures be normalized; `repo` marks the
    launch's processes as the repository's (orphans.py); `one_process`: the trainer is the
    launch's only process (no torchrun), rank 0, its exit status its own. KeyboardInterrupt
    (Ctrl-C, or SIGTERM turned into one by the caller) stops every process of the launch and
    is re-raised once they are all gone.
    """
    echo = echo or sys.stdout
    token = uuid.uuid4().hex

    def notify(text: str) -> None:
        print(f"[moe_perf] {label}: {text}", file=echo, flush=True)

    console_log = arm_dir / "console.log"
    with open(console_log, "w", encoding="utf-8") as log:
        log.write("# " + " ".join(argv) + "\n")
        start = time.perf_counter()
        proc = _popen(argv, cwd, trainer_env(cwd, arm_dir, token, env, repo), one_process)
        reader = LogReader(log_format, shape)
        streams = [proc.stdout] if one_process else [proc.stdout, proc.stderr]
        pump = _Pump(streams, log, label, echo, reader, max_steps)
        pump.start()
        exit_code, timed_out = _wait(proc, pump, label, token, timeout_s, kill_grace_s, notify)
        wall_s = time.perf_counter() - start
        if stop_launch(proc, token, kill_grace_s):  # stray workers of a finished launch, if any
            raise KeyboardInterrupt("Ctrl-C while a finished arm's workers were stopped")
        pump.join(timeout=10)
    parsed = reader.result()
    launch = LaunchFailure(None, None, None, None)
    if exit_code != 0 and not timed_out:
        launch = read_failure(_tail(console_log, 256 * 1024), exit_code if one_process else None)
    failure = failure_of(exit_code, timed_out, timeout_s, parsed, max_steps, launch)
    if failure and not timed_out and failure_reason is not None:
        failure = failure_reason(exit_code, _tail(console_log, 8000)) or failure
    # the trainer's own exit code where torchrun reported it (torchrun itself exits 1), or as
    # it exited when it ran alone
    trainer_code = launch.exit_code if launch.exit_code is not None else exit_code
    return LaunchResult(trainer_code, failure, parsed.steps, reader.env, round(wall_s, 3),
                        parsed.log_format, parsed.derivations, exit_code, timed_out)  # fmt: skip


def _popen(argv: list[str], cwd: Path, env: dict[str, str], one_process: bool) -> subprocess.Popen:
    return subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        # one process: its own two streams in one pipe keep their order; torchrun's
        # tees: one pipe each (_Pump)
        stderr=subprocess.STDOUT if one_process else subprocess.PIPE,
        text=True,
        errors="replace",
        bufsize=1,
        start_new_session=True,  # Ctrl-C reaches us only; we stop the launch ourselves
    )


def _wait(proc: subprocess.Popen, pump: _Pump, label: str, token: str, timeout_s: float,
          kill_grace_s: float, notify: Callable[[str], None]) -> tuple[int, bool]:  # fmt: skip
    """(the launch's exit code, whether it timed out): the launch stopped at its timeout, and
    on Ctrl-C (re-raised once every process of the launch is gone)."""
    # The wait runs in a thread and this one joins it: a Ctrl-C landing inside
    # Popen.wait() itself, between its taking of the waitpid lock and the try that
    # releases it, leaves the lock held, and every poll() after it answers "running" for a
    # trainer that has exited (seen once: the sweep then waited forever on a zombie).
    # Thread.join releases what it holds when interrupted.
    waiter = threading.Thread(target=proc.wait, name=f"wait-{label}", daemon=True)
    waiter.start()
    timed_out = False
    try:
        waiter.join(timeout_s)
        if waiter.is_alive():
            timed_out = True
            if stop_launch(proc, token, kill_grace_s):
                raise KeyboardInterrupt("Ctrl-C while a timed-out arm was stopped")
        waiter.join()
        return proc.returncode, timed_out
    except BaseException as exc:
        pump.quiet = True  # torchrun's traceback of the signal: console.log only
        if isinstance(exc, KeyboardInterrupt):
            notify(f"interrupted: stopping the arm (SIGTERM to its processes); waiting up to "
                   f"{kill_grace_s:g} s (launcher.kill_grace_s) for them to exit, then "
                   f"SIGKILL; Ctrl-C again to SIGKILL now")  # fmt: skip
        stop_launch(proc, token, kill_grace_s, notify)
        pump.join(timeout=5)
        raise


# ---- a command before the launch (a build step) ----------------------------------------------


@dataclass(frozen=True)
class CommandResult:
    exit_code: int | None  # None: stopped at its timeout
    wall_s: float
    timed_out: bool = False


def run_logged(argv: list[str], *, cwd: Path, arm_dir: Path, log_path: Path, label: str,
               timeout_s: float, kill_grace_s: float, env: dict[str, str] | None = None,
               repo: Path | None = None, echo: TextIO | None = None,
               heartbeat_s: float = 30.0) -> CommandResult:  # fmt: skip
    """Runs `argv` to its end with the arm's environment (`trainer_env`: the same PYTHONPATH,
    and the launch markers, so a dead runner's leftover is found as a launch's would be), all
    its output in `log_path`; says every `heartbeat_s` that it is still running. Stopped, with
    every process it started, at `timeout_s` or at Ctrl-C (KeyboardInterrupt re-raised once
    they are gone)."""
    echo = echo or sys.stdout
    token = uuid.uuid4().hex
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("# " + " ".join(argv) + "\n")
        log.flush()
        start = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=cwd, env=trainer_env(cwd, arm_dir, token, env, repo),
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        waiter = threading.Thread(target=proc.wait, name=f"wait-{label}", daemon=True)
        waiter.start()  # joined, not waited on: see run_trainer
        try:
            while waiter.is_alive() and time.perf_counter() - start < timeout_s:
                waiter.join(min(heartbeat_s, max(0.0, timeout_s - (time.perf_counter() - start))))
                if waiter.is_alive():
                    print(f"[moe_perf] {label}: still running, {time.perf_counter() - start:.0f} s "
                          f"(log: {log_path})", file=echo, flush=True)  # fmt: skip
        except BaseException:
            stop_launch(proc, token, kill_grace_s)
            raise
        timed_out = waiter.is_alive()
        if stop_launch(proc, token, kill_grace_s):  # at its timeout, or what it left running
            raise KeyboardInterrupt("Ctrl-C while a command was stopped")
        waiter.join()
    wall_s = round(time.perf_counter() - start, 3)
    return CommandResult(None if timed_out else proc.returncode, wall_s, timed_out)


def _tail(path: Path, size: int) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - size))
        return f.read().decode("utf-8", errors="replace")
