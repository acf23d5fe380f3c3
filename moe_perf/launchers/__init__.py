"""Where an arm's processes run: one small interface (base.Launcher), one module per launcher."""

from __future__ import annotations

from typing import Any

from moe_perf.common.errors import PrerequisiteError
from moe_perf.launchers.base import Launcher
from moe_perf.launchers.local import LocalLauncher
from moe_perf.launchers.slurm import SlurmLauncher

# the one registry of launchers, by the name of each one's schema (conf/launcher/<name>.yaml)
LAUNCHERS: dict[str, type] = {cls.name: cls for cls in (LocalLauncher, SlurmLauncher)}


def get(cfg: Any) -> Launcher:
    """The launcher that `launcher=<name>` selects."""
    name = str(cfg.launcher.name)
    if name not in LAUNCHERS:
        raise PrerequisiteError(
            f"launcher={name} is not a launcher of this moe_perf: use one of "
            f"{', '.join(sorted(LAUNCHERS))}"
        )
    return LAUNCHERS[name]()
