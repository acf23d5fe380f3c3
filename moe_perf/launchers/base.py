"""What every launcher shares: the torchrun command line, and the interface a launcher has.

A launcher decides WHERE an arm's processes run: `local` (torchrun on this machine; an arm of
one process runs without it, about 2.5 s less on a 2-core CPU and 5 s on an H200 per arm) or
`slurm` (the same torchrun as an srun step over the allocation's nodes). What runs (the
trainer's own command line) comes from the framework adapter; how the output is read and the
processes are stopped is the same for every launcher (process.py).
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from omegaconf import MISSING

from moe_perf.common.bounds import knob

# launcher.kill_grace_s's default: seconds between SIGTERM and SIGKILL when an arm is stopped
# (timeout, Ctrl-C), and when a dead sweep's leftovers are stopped
KILL_GRACE_S = 10.0


@dataclass
class LauncherSchema:
    """What every launcher option has (its own schema adds the rest)."""

    name: str = MISSING  # launcher=<name>
    kill_grace_s: float = knob(KILL_GRACE_S, min=0)


class Launcher(Protocol):
    name: str  # launcher=<name>: its schema's `name`
    schema: type  # the option's Hydra schema (a LauncherSchema)

    def check(self, cfg: Any, *, submitting: bool = False) -> None:
        """Raises PrerequisiteError when this launcher cannot run the arm from here.

        `submitting`: checked in a process that only submits the sweep (each job checks again
        where it runs), so checks of the host itself are skipped.
        """

    def argv(self, cfg: Any, arm_dir: Path, trainer_argv: Sequence[str]) -> list[str]:
        """The whole command line of one arm: the launch wrapped around the trainer's argv."""

    def build_argv(self, cfg: Any, label: str, build_argv: Sequence[str]) -> list[str]:
        """The command line of the arm's build step (trainer.build): run where what it builds
        is what the arm's processes import."""

    def env(self, cfg: Any) -> dict[str, str]:
        """What the launch adds to the trainer's environment (beyond torchrun's own)."""

    def one_process(self, cfg: Any) -> bool:
        """True when the trainer runs as the launch's only process, without torchrun: its exit
        status is then the trainer's own, and it is rank 0."""

    def failure_reason(self, exit_code: int | None, console_tail: str) -> str | None:
        """A reason more precise than the exit code, read from the launch's last output."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def torchrun_argv(cfg: Any, arm_dir: Path, port: int) -> list[str]:
    """`python -m torch.distributed.run <flags>`, to which the trainer's argv is appended."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(cfg.mesh.nnodes),
        "--nproc-per-node", str(cfg.mesh.nproc_per_node),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"localhost:{port}",
        "--log-dir", str(arm_dir / "torchrun"),
        "--tee", "3",
    ]  # fmt: skip


def one_process_env(port: int) -> dict[str, str]:
    """What torchrun gives its one worker of a one-process launch (env:// rendezvous on this
    host), so that a trainer started without it sees the same world: rank 0 of 1."""
    return {
        "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0", "ROLE_NAME": "default",
        "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "1",
        "MASTER_ADDR": "localhost", "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "False",
    }  # fmt: skip
