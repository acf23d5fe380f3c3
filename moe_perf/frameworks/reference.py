"""`trainer=reference`: the reference trainer, or any trainer that keeps the moe_perf contract
(docs/trainer-contract.md): `trainer.command` followed by the resolved config's path, one
`[moe_perf] step=` line per optimizer step."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from moe_perf.common.armcode import check_fp8_host
from moe_perf.common.config import TrainerConfig
from moe_perf.common.errors import PrerequisiteError
from moe_perf.frameworks.base import BuildKeys, TrainerLaunch

REFERENCE_COMMAND = ["-m", "moe_perf.trainer"]


@dataclass
class ReferenceTrainerSchema(TrainerConfig, BuildKeys):
    """The reference trainer's knobs plus how the runner launches it."""

    command: list[str] = field(default_factory=lambda: list(REFERENCE_COMMAND))
    code_path: Optional[str] = "moe_perf/trainer"  # noqa: UP045
    env: dict[str, Any] = field(default_factory=dict)


def runs_reference_trainer(cfg: Any) -> bool:
    """Whether the arms run moe_perf's own trainer: `trainer=reference` with its command (the
    same adapter runs any contract trainer given by `trainer.command`)."""
    command = [str(part) for part in cfg.trainer.get("command") or []]
    return str(cfg.trainer.name) == ReferenceTrainerSchema.name and command == REFERENCE_COMMAND


class ContractTrainer:
    schema = ReferenceTrainerSchema
    name = schema.name

    def check(self, cfg: Any, repo: Path) -> None:
        if not list(cfg.trainer.command or []):
            raise PrerequisiteError(
                "trainer.command is empty: set e.g. trainer.command=[-m,mytrainer]"
            )

    def check_host(self, cfg: Any) -> None:
        """fp8: the reference trainer's float8 linears are torchao's (another contract trainer
        brings its own: only the device is checked for it)."""
        check_fp8_host(cfg, torchao=runs_reference_trainer(cfg))

    def launch(self, cfg: Any, arm_dir: Path, config_path: Path, worktree: Path) -> TrainerLaunch:
        argv = [str(part) for part in cfg.trainer.command] + [str(config_path)]
        env = {str(k): str(v) for k, v in (cfg.trainer.get("env") or {}).items()}
        return TrainerLaunch(argv=argv, env=env, log_format="contract")
