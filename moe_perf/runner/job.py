"""Where one job (one arm) runs and writes, and the runner's one way of speaking."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SWEEP_DIR = Path("outputs/validate-performance")


@dataclass
class Job:
    """Where one Hydra job (one arm) runs and writes."""

    arm_dir: Path
    sweep_dir: Path
    cwd: Path
    num: int = 0
    multirun: bool = False
    total: int | None = None  # jobs in this sweep, when the sweeper's order is known
    config_name: str = "config"
    overrides: list[str] = field(default_factory=list)


def repeat_suffix(repeat: Any, task_overrides: Any = ()) -> str:
    """`-r<repeat>` when the sweep sets `repeat` or it is non-zero, so repeats never overwrite."""
    swept = any(str(o).lstrip("+~").startswith("repeat=") for o in task_overrides or ())
    return f"-r{int(repeat)}" if swept or int(repeat) != 0 else ""


def standalone_job(cfg: Any) -> Job:
    """The layout the command uses, for callers of run_arm outside Hydra."""
    cwd = Path.cwd()
    name = f"{cfg.tag}-{cfg.arm.name}{repeat_suffix(cfg.repeat)}"
    return Job(arm_dir=cwd / SWEEP_DIR / cfg.model.name / name, sweep_dir=cwd / SWEEP_DIR, cwd=cwd)


def say(text: str, stream=None) -> None:
    print(f"[moe_perf] {text}", file=stream or sys.stdout, flush=True)
