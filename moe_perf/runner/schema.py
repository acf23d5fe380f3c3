"""Typed schema of the composed config, and the resolvers its YAML uses.

Registered on import (with replace=True, so re-imports in tests are harmless). The YAML files
in conf/ give the values; this gives the types, so `training.max_steps=abc` fails at compose time
with Hydra's message. `model`, `trainer` and `launcher` stay open (Any): their option files
carry keys that belong to the trainer and the launchers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from moe_perf.common.mesh import MeshDims
from moe_perf.runner import git
from moe_perf.runner.job import repeat_suffix

# The Optional[...] spelling is for OmegaConf, which does not read `X | None` on Python 3.10.


@dataclass
class MeshConfig:
    nnodes: int = MISSING
    nproc_per_node: int = MISSING
    pp: int = MISSING
    cp: int = MISSING
    ep: int = MISSING


@dataclass
class DtypeConfig:
    name: str = MISSING
    fp8: bool = MISSING


@dataclass
class ArmConfig:
    name: str = MISSING
    ref: Optional[str] = MISSING  # noqa: UP045


@dataclass
class RefsConfig:
    base: Optional[str] = MISSING  # noqa: UP045
    feat: Optional[str] = MISSING  # noqa: UP045


@dataclass
class TrainingConfig:
    sequence_length: int = MISSING
    global_batch: int = MISSING
    micro_batch: int = MISSING
    max_steps: int = MISSING
    benchmark: bool = MISSING
    seed: int = MISSING
    lr: float = MISSING
    device: str = MISSING


@dataclass
class DataConfig:
    corpus: Optional[str] = None  # noqa: UP045
    root: str = MISSING


@dataclass
class WandbConfig:
    mode: str = MISSING
    project: str = MISSING
    entity: Optional[str] = None  # noqa: UP045


@dataclass
class MoePerfConfig:
    model: Any = MISSING
    mesh: MeshConfig = MISSING
    dtype: DtypeConfig = MISSING
    arm: ArmConfig = MISSING
    trainer: Any = MISSING
    launcher: Any = MISSING
    tag: str = MISSING
    repo: str = MISSING
    refs: RefsConfig = field(default_factory=RefsConfig)
    repeat: int = MISSING
    timeout_s: float = MISSING
    dry_run: bool = False
    explain: bool = False
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


def mesh_dims(mesh: Any) -> MeshDims:
    """The MeshDims of a `mesh` config node (world = nnodes * nproc_per_node)."""
    return MeshDims(
        world=int(mesh.nnodes) * int(mesh.nproc_per_node),
        pp=int(mesh.pp),
        cp=int(mesh.cp),
        ep=int(mesh.ep),
    )


def _tag(nnodes, nproc_per_node, pp, cp, ep, sequence_length, dtype) -> str:
    dims = MeshDims(world=int(nnodes) * int(nproc_per_node), pp=int(pp), cp=int(cp), ep=int(ep))
    return dims.tag(int(sequence_length), str(dtype))


def _current_branch(repo: str) -> Optional[str]:  # noqa: UP045
    return git.current_branch(repo)


def register() -> None:
    ConfigStore.instance().store(name="moe_perf_schema", node=MoePerfConfig)
    OmegaConf.register_new_resolver("moe_perf.tag", _tag, replace=True)
    OmegaConf.register_new_resolver("moe_perf.repeat_suffix", repeat_suffix, replace=True)
    # Evaluated per job; the runner replaces `refs` by what the sweep resolved at its start.
    OmegaConf.register_new_resolver("moe_perf.current_branch", _current_branch, replace=True)


register()
