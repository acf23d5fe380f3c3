"""`trainer=command`: any framework, by its own command line and its own per-step log lines.

`trainer.command` is what torchrun runs (a script path or `-m module`, then its arguments); each
`{key.path}` in it is filled from the arm's composed config (`--pp={mesh.pp}`,
`--global-batch={training.global_batch}`), plus a few values of the arm itself: `{config_path}`
(the resolved config.yaml the runner wrote), `{arm_dir}`, `{worktree}`, `{world_size}` and
`{dp}` (inferred from the mesh), `{python}` (the interpreter the arms run). `trainer.log_format`
names how the trainer prints a step: contract, torchtitan, megatron, nemo, or a regex with named
groups (moe_perf/logs/regex.py).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, OmegaConf

from moe_perf.common.errors import PrerequisiteError
from moe_perf.frameworks.base import BuildKeys, TrainerLaunch
from moe_perf.logs import line_parser

# `{mesh.pp}`; braces around anything else (`{"a": 1}`) are left as they are
_PLACEHOLDER_RE = re.compile(r"\{([A-Za-z_][\w-]*(?:\.[\w-]+)*)\}")
_SCALARS = (str, int, float, bool)


def arm_values(cfg: Any, arm_dir: Path, config_path: Path, worktree: Path) -> dict[str, str]:
    """The placeholders that are not config keys: the arm's paths and the inferred mesh sizes."""
    world = int(cfg.mesh.nnodes) * int(cfg.mesh.nproc_per_node)
    return {
        "config_path": str(config_path),
        "arm_dir": str(arm_dir),
        "worktree": str(worktree),
        "world_size": str(world),
        "dp": str(world // (int(cfg.mesh.pp) * int(cfg.mesh.cp))),
        "python": sys.executable,
    }


def _text(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def fill(command: list, cfg: Any, arm: dict[str, str], key: str = "trainer.command") -> list[str]:
    """The command (the value of `key`) with every placeholder filled; an unknown or
    non-scalar one is an error that names `key`."""

    def value(match: re.Match) -> str:
        name = match.group(1)
        if name in arm:
            return arm[name]
        found = OmegaConf.select(cfg, name, default=KeyError, throw_on_missing=False)
        if found is KeyError:
            raise PrerequisiteError(
                f"{key}: unknown placeholder {{{name}}}: no key {name} in the composed "
                f"config (nor one of {', '.join('{' + k + '}' for k in arm)})"
            )
        if found is None or not isinstance(found, _SCALARS):
            raise PrerequisiteError(
                f"{key}: placeholder {{{name}}} is {found!r}, not one value; "
                f"name a scalar key (e.g. {{mesh.pp}})"
            )
        return _text(found)

    return [_PLACEHOLDER_RE.sub(value, str(part)) for part in command]


def fill_env(env: dict[str, str], cfg: Any, arm: dict[str, str]) -> dict[str, str]:
    """The trainer's environment with the placeholders of its values filled, as the command's
    (`PYTHONPATH: "{worktree}/.build"`: a per-arm build prefix, docs/build.md)."""
    return {name: fill([value], cfg, arm, f"trainer.env.{name}")[0] for name, value in env.items()}


@dataclass
class CommandTrainerSchema(BuildKeys):
    name: str = "command"
    command: list[str] = MISSING
    log_format: str = "contract"
    env: dict[str, Any] = field(default_factory=dict)
    code_path: Optional[str] = None  # noqa: UP045


class CommandTrainer:
    schema = CommandTrainerSchema
    name = schema.name

    def check(self, cfg: Any, repo: Path) -> None:
        command = list(cfg.trainer.get("command") or [])
        if not command:
            raise PrerequisiteError(
                "trainer.command is empty: set the framework's command, e.g. "
                "'trainer.command=[train.py,--config,my.toml,\"--pp={mesh.pp}\"]'"
            )
        fill(command, cfg, arm_values(cfg, Path("arm_dir"), Path("config.yaml"), repo))
        log_format = str(cfg.trainer.get("log_format") or "")
        try:
            line_parser(log_format)
        except ValueError as err:
            raise PrerequisiteError(
                f"trainer.log_format={log_format!r}: {err}; use contract, torchtitan, megatron, "
                f"nemo or a regex with named groups"
            ) from None

    def launch(self, cfg: Any, arm_dir: Path, config_path: Path, worktree: Path) -> TrainerLaunch:
        arm = arm_values(cfg, arm_dir, config_path, worktree)
        env = {str(k): _text(v) for k, v in (cfg.trainer.get("env") or {}).items()}
        return TrainerLaunch(
            argv=fill(list(cfg.trainer.command), cfg, arm),
            env=env,
            log_format=str(cfg.trainer.log_format),
        )
