"""`launcher.preload`: one-process arms forked from an interpreter that imported torch once per
sweep (forkserver.py), instead of each arm importing it again.

The server starts with the first arm that asks for it, while the runner prepares that arm, and
serves every later arm whose environment it was started with; an arm whose environment differs
in anything but what is the arm's own (its PYTHONPATH, arm directory, launch token and
rendezvous port) gets a server of its own, the old one stopped. The server carries the sweep's
repository and a launch token in its environment, as every launch does, so a dead runner's
server and its children are found and stopped by the next sweep (orphans.py); it also exits by
itself when the runner is gone. `SweepSession.end` stops it with the sweep's worktrees.

An arm forked from it gets the arm's command line, environment, cwd and streams and runs as
`python ARGV` would; `preload.json` in its directory says whether it was served and, if not,
why (a directory early on its path with its own copy of a preloaded package, an interpreter
option, a server that could not import). The record carries it (`extra.preload`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_perf.common.config import gpu_expected
from moe_perf.launchers.orphans import LAUNCH_REPO_ENV, LAUNCH_TOKEN_ENV
from moe_perf.launchers.process import trainer_env

FORKSERVER = Path(__file__).with_name("forkserver.py")
INFO_FILE = "preload.json"
# what every arm of one environment shares; an arm's own values of these do not count
ARM_OWN = ("PYTHONPATH", "MOE_PERF_ARM_DIR", LAUNCH_TOKEN_ENV, "MASTER_PORT")


@dataclass
class _Server:
    proc: subprocess.Popen
    directory: Path
    key: str

    @property
    def socket(self) -> Path:
        return self.directory / "socket"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM to the server's group (its children are in it), SIGKILL after `grace_s`."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(wait_s)
        shutil.rmtree(self.directory, ignore_errors=True)


def _key(env: dict[str, str]) -> str:
    return json.dumps({k: v for k, v in sorted(env.items()) if k not in ARM_OWN})


@dataclass
class Preloader:
    """The sweep's server (at most one at a time) and the launches it serves."""

    modules: tuple[str, ...]
    server: _Server | None = None

    def warm(self, worktree: Path, arm_dir: Path, env: dict[str, str], repo: Path | None) -> None:
        """The server for the arm's environment (`trainer_env` of `env`, what the launch adds)
        started now, if it is not running, so that it imports while the runner prepares the
        arm."""
        whole = trainer_env(worktree, arm_dir, "", env, repo)
        if self.server is not None and (not self.server.alive() or self.server.key != _key(whole)):
            self.stop()
        if self.server is None:
            self.server = self._start(whole, repo)

    def argv(self, trainer_argv: list[str], worktree: Path, arm_dir: Path, env: dict[str, str],
             repo: Path | None) -> list[str]:  # fmt: skip
        """The arm's launch through the server: `python forkserver.py run ... -- ARGV`, where
        `trainer_argv` is `python ARGV` and `env` what the launch adds to the environment."""
        self.warm(worktree, arm_dir, env, repo)
        server = self.server
        return [sys.executable, str(FORKSERVER), "run", str(server.socket), str(server.proc.pid),
                str(arm_dir / INFO_FILE), "--", *trainer_argv[1:]]  # fmt: skip

    def _start(self, env: dict[str, str], repo: Path | None) -> _Server:
        directory = Path(tempfile.mkdtemp(prefix="moe_perf-preload-"))
        own = {k: v for k, v in env.items() if k not in ARM_OWN}
        pythonpath = os.environ.get("PYTHONPATH")  # the runner's; each arm adds its own
        server_env = {**own, **({"PYTHONPATH": pythonpath} if pythonpath else {}),
                      LAUNCH_TOKEN_ENV: f"preload-{uuid.uuid4().hex}"}  # fmt: skip
        if repo is not None:
            server_env[LAUNCH_REPO_ENV] = str(Path(repo).resolve())
        with open(directory / "server.log", "w", encoding="utf-8") as log:
            proc = subprocess.Popen(
                [sys.executable, str(FORKSERVER), "serve", str(directory / "socket"),
                 str(os.getpid()), *self.modules],
                cwd=directory,
                env=server_env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # no Ctrl-C of the terminal; stopped as a group
            )  # fmt: skip
        return _Server(proc, directory, _key(env))

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def wanted(cfg: Any, several_arms: bool = True) -> bool:
    """launcher.preload, or where it is unset (null), whether the sweep runs several arms of the
    reference trainer on a GPU: where the gain was measured (an H100: warm arms 11.7-12.8 s ->
    8.0-8.6 s); a sweep of one arm only waits for the server. A GPU is there when
    training.device is cuda, or auto with an NVIDIA device node."""
    if str(cfg.launcher.name) != "local":  # the arm runs where this process is not
        return False
    setting = cfg.launcher.get("preload")
    if setting is not None:
        return bool(setting)
    if str(cfg.trainer.get("name")) != "reference" or not several_arms:
        return False
    return gpu_expected(str(cfg.training.device))


def preloaded(cfg: Any, launcher: Any, trainer_argv: Sequence[str], multirun: bool,
              total: int | None) -> bool:  # fmt: skip
    """Whether the arm runs forked from the sweep's preloaded interpreter (launcher.preload):
    a one-process arm whose command is `-m module` or a script, with no interpreter option.
    `multirun`, `total`: the arm's job (total None: the sweep's size is not known yet)."""
    several_arms = multirun and (total is None or total > 1)
    if not wanted(cfg, several_arms) or not launcher.one_process(cfg):
        return False
    first = str(trainer_argv[0]) if trainer_argv else "-"
    return first == "-m" or not first.startswith("-")


def read_info(arm_dir: Path) -> dict | None:
    """What the arm's launch wrote about the server (`preload.json`), if anything."""
    try:
        return json.loads((arm_dir / INFO_FILE).read_text())
    except (OSError, ValueError):
        return None
