"""What every launcher shares: the torchrun command line, and the interface a launcher has.

A launcher decides WHERE an arm's processes run: `local` (torchrun on this machine) or `slurm`
(the same torchrun as an srun step over the allocation's nodes). What runs (the trainer's own
command line) comes from the framework adapter; how the output is read and the processes are
stopped is the same for every launcher (process.py).
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol


class Launcher(Protocol):
    name: str

    def check(self, cfg: Any, *, submitting: bool = False) -> None:
        """Raises PrerequisiteError when this launcher cannot run the arm from here.

        `submitting`: checked in a process that only submits the sweep (each job checks again
        where it runs), so checks of the host itself are skipped.
        """

    def argv(self, cfg: Any, arm_dir: Path, trainer_argv: Sequence[str]) -> list[str]:
        """The whole command line of one arm: the launch wrapped around the trainer's argv."""

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
