"""`launcher=local`: torchrun on this machine, one node."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moe_perf.common.errors import PrerequisiteError
from moe_perf.launchers.base import free_port, torchrun_argv


class LocalLauncher:
    name = "local"

    def check(self, cfg: Any, *, submitting: bool = False) -> None:
        if int(cfg.mesh.nnodes) != 1:
            raise PrerequisiteError(
                f"mesh.nnodes={cfg.mesh.nnodes} but launcher=local runs on this machine only: "
                f"pick a one-node mesh or a multi-node launcher (launcher=slurm)"
            )

    def argv(self, cfg: Any, arm_dir: Path, trainer_argv: Sequence[str]) -> list[str]:
        return torchrun_argv(cfg, arm_dir, free_port()) + list(trainer_argv)

    def failure_reason(self, exit_code: int | None, console_tail: str) -> str | None:
        return None  # the trainer's own words are in console.log; the exit code says the rest
