"""One adapter per trainer a sweep can run (base.Framework); `get(cfg)` picks it by
`trainer.name`."""

from __future__ import annotations

from typing import Any

from moe_perf.common.errors import PrerequisiteError
from moe_perf.frameworks.base import Framework, TrainerLaunch
from moe_perf.frameworks.command import CommandTrainer
from moe_perf.frameworks.megatron import Megatron
from moe_perf.frameworks.reference import ContractTrainer
from moe_perf.frameworks.torchtitan import TorchTitan

# the one registry of trainer adapters, by the name of each one's schema
# (conf/trainer/<name>.yaml)
FRAMEWORKS: dict[str, type] = {
    cls.name: cls for cls in (ContractTrainer, CommandTrainer, TorchTitan, Megatron)
}

__all__ = ["FRAMEWORKS", "Framework", "TrainerLaunch", "get"]


def get(cfg: Any) -> Framework:
    name = str(cfg.trainer.name)
    if name not in FRAMEWORKS:
        raise PrerequisiteError(
            f"trainer={name} has no adapter in this moe_perf: use one of "
            f"{', '.join(sorted(FRAMEWORKS))}"
        )
    return FRAMEWORKS[name]()
