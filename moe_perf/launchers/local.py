"""`launcher=local`: torchrun on this machine, one node; an arm of one process without it.

torchrun's start and exit cost about 2.5 s per arm on a 2-core CPU and 5 s on an H200, most of
it its own `import torch` and rendezvous. A one-process arm gets torchrun's environment for its
one worker instead (rank 0 of 1, an env:// rendezvous on a free port), so every trainer sees the
same world; its output has no `[rank0]:` prefixes and no `torchrun/` logs (console.log holds
it all), and its exit status is the trainer's own.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from moe_perf.common.errors import PrerequisiteError
from moe_perf.launchers.base import LauncherSchema, free_port, one_process_env, torchrun_argv

# What launcher.preload imports once per sweep (forkserver.py): torch, dynamo and inductor, the
# imports of every compiled arm before its first line of training.
PRELOAD_MODULES = ["torch", "torch._dynamo", "torch._inductor.compile_fx"]


@dataclass
class LocalLauncherSchema(LauncherSchema):
    name: str = "local"
    # one-process arms forked from an interpreter that imported preload_modules once per sweep
    # (launchers/preload.py); None: a sweep of several reference-trainer arms on a GPU, where
    # its gain was measured (docs/benchmarks/preload-h100-2026-12.md)
    preload: Optional[bool] = None  # noqa: UP045 (OmegaConf's schemas take Optional only)
    preload_modules: list[str] = field(default_factory=lambda: list(PRELOAD_MODULES))


class LocalLauncher:
    schema = LocalLauncherSchema
    name = schema.name

    def check(self, cfg: Any, *, submitting: bool = False) -> None:
        if int(cfg.mesh.nnodes) != 1:
            raise PrerequisiteError(
                f"mesh.nnodes={cfg.mesh.nnodes} but launcher=local runs on this machine only: "
                f"pick a one-node mesh or a multi-node launcher (launcher=slurm)"
            )

    def one_process(self, cfg: Any) -> bool:
        return int(cfg.mesh.nnodes) * int(cfg.mesh.nproc_per_node) == 1

    def argv(self, cfg: Any, arm_dir: Path, trainer_argv: Sequence[str]) -> list[str]:
        if self.one_process(cfg):
            return [sys.executable, *trainer_argv]  # as torchrun runs it: python <script|-m mod>
        return torchrun_argv(cfg, arm_dir, free_port()) + list(trainer_argv)

    def build_argv(self, cfg: Any, label: str, build_argv: Sequence[str]) -> list[str]:
        return list(build_argv)  # this machine is where the arm runs

    def env(self, cfg: Any) -> dict[str, str]:
        return one_process_env(free_port()) if self.one_process(cfg) else {}

    def failure_reason(self, exit_code: int | None, console_tail: str) -> str | None:
        return None  # the trainer's own words are in console.log; the exit code says the rest
