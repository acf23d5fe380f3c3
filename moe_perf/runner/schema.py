"""The Hydra schema of the composed config, and the resolvers its YAML uses.

The sections the trainer reads are the dataclasses of moe_perf/common/config.py, registered as
they are: one set of fields, types, defaults and ranges. A trainer option's schema is its
adapter's (moe_perf/frameworks/), a launcher's its launcher's (moe_perf/launchers/). This module
adds only what the runner alone reads (arm, refs, wandb, the root keys) and registers, on
import (replace=True, so re-imports in tests are harmless):

* `moe_perf_schema`, the root: `model`, `mesh`, `dtype`, `training`, `data` typed, so
  `model.num_experts=abc` fails at compose time with Hydra's message;
* per option of the `trainer` and `launcher` groups, `moe_perf_schema/<group>/<option>`, which
  conf/<group>/<option>.yaml names first in its defaults list (Hydra's pattern for a group
  whose options have different fields);
* the resolvers `moe_perf.tag`, `moe_perf.routing_tag`, `moe_perf.repeat_suffix`,
  `moe_perf.current_branch`, `moe_perf.path_part`.

Hydra adds a key given with `+` even to a typed node, so unknown keys are found after compose
by `unknown_keys` (the pre-flight refuses them), as are values out of range (`out_of_range`).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from moe_perf import frameworks, launchers
from moe_perf.common.config import (
    DataConfig,
    DtypeConfig,
    MeshConfig,
    ModelConfig,
    RoutingConfig,
    TrainingConfig,
    check_values,
    knob,
)
from moe_perf.common.mesh import MeshDims, MeshError
from moe_perf.common.routing import tag_suffix
from moe_perf.frameworks.reference import ReferenceTrainerSchema as ReferenceTrainerSchema
from moe_perf.runner import git, presets
from moe_perf.runner.job import repeat_suffix
from moe_perf.stats.verdict import DEFAULT_MAX_PAIRS, MEMORY_TOLERANCE, Plan

# Optional[...] rather than `X | None`: see moe_perf/common/config.py.


@dataclass
class ArmConfig:
    name: str = knob(MISSING, choices=("base", "feat"))
    ref: Optional[str] = MISSING  # noqa: UP045


@dataclass
class RefsConfig:
    base: Optional[str] = MISSING  # noqa: UP045
    feat: Optional[str] = MISSING  # noqa: UP045


@dataclass
class WandbConfig:
    mode: str = knob("auto", choices=("auto", "online", "offline", "disabled"))
    project: str = "moe_perf"
    entity: Optional[str] = None  # noqa: UP045


@dataclass
class CompareConfig:
    """The verdict's knobs (moe_perf/stats/verdict.py, docs/verdict.md)."""

    effect: float = knob(Plan.effect, above=0, max=0.99, why="a relative change below 100%")
    confidence: float = knob(Plan.confidence, min=0.5, max=0.9999,
                             why="an interval of confidence 1 never decides")  # fmt: skip
    max_pairs: int = knob(DEFAULT_MAX_PAIRS, min=1, max=100)
    max_minutes: Optional[float] = knob(None, above=0)  # noqa: UP045
    memory_tolerance: float = knob(MEMORY_TOLERANCE, min=0, max=1)


# Each trainer adapter and each launcher owns its option's schema (its class's `schema`), named
# by its schema's `name`; conf/trainer/ and conf/launcher/ hold one option file per name.
OPTION_SCHEMAS = {
    "trainer": {name: adapter.schema for name, adapter in frameworks.FRAMEWORKS.items()},
    "launcher": {name: launcher.schema for name, launcher in launchers.LAUNCHERS.items()},
}


@dataclass
class MoePerfConfig:
    model: ModelConfig = MISSING
    mesh: MeshConfig = field(default_factory=MeshConfig)
    dtype: DtypeConfig = field(default_factory=DtypeConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    # typed by the option's own schema (OPTION_SCHEMAS), named in its defaults list
    trainer: Any = MISSING
    launcher: Any = MISSING
    arm: ArmConfig = MISSING
    tag: str = MISSING
    repo: str = "."
    refs: RefsConfig = field(default_factory=RefsConfig)
    repeat: int = knob(0, min=0)
    compare: CompareConfig = field(default_factory=CompareConfig)
    timeout_s: float = knob(1800.0, above=0)
    dry_run: bool = False
    explain: bool = False
    compile_cache: str = "auto"  # auto | off | a directory (moe_perf/runner/compile_cache.py)
    wandb: WandbConfig = field(default_factory=WandbConfig)


# --- checks of a composed config --------------------------------------------------------------


def _schema_of(node: Any) -> type | None:
    kind = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
    return kind if kind is not None and dataclasses.is_dataclass(kind) else None


def unknown_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """One message per key of `cfg` that its schema does not have (as `+a.b=x` adds them),
    with the closest known key when there is one. `hydra` is Hydra's own."""
    schema = _schema_of(cfg)
    if schema is None:
        return []
    fields = [f.name for f in dataclasses.fields(schema)]
    problems = []
    for key in cfg.keys():
        path = f"{prefix}{key}"
        if key == "hydra" and not prefix:
            continue
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            where = f"the {prefix.rstrip('.')} section" if prefix else "the config"
            problems.append(f"{path} is not a key of {where}{hint}; remove or correct it")
        elif isinstance(cfg._get_node(key), DictConfig):
            problems += unknown_keys(cfg._get_node(key), f"{path}.")
    return problems


def out_of_range(cfg: DictConfig) -> list[str]:
    """One message per value outside its field's range or choices (common/config.py knobs)."""
    problems = check_values(MoePerfConfig, cfg, "")
    for group in OPTION_SCHEMAS:
        schema = _schema_of(cfg.get(group))
        if schema is not None:
            problems += check_values(schema, cfg[group], group)
    return problems


# --- resolvers ----------------------------------------------------------------------------------


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
    if dims.pp < 1 or dims.cp < 1:  # refused by the pre-flight; no ZeroDivisionError before it
        return f"pp{dims.pp}-dp0-cp{dims.cp}-ep{dims.ep}-seq{sequence_length}-{dtype}"
    return dims.tag(int(sequence_length), str(dtype))


def micro_batch_upto(cap, global_batch, nnodes, nproc_per_node, pp, cp) -> int:
    """The largest micro-batch <= `cap` that the batch checks accept (`MeshDims.check_batch`:
    it divides a data rank's batch and, under pp > 1, leaves pp micro-batches); 1 when none
    does (the pre-flight then says what to change). For workloads whose micro-batch is a speed
    choice, not a memory limit (the tiny model on CPU, conf/training/cpu.yaml)."""
    dims = MeshDims(world=int(nnodes) * int(nproc_per_node), pp=int(pp), cp=int(cp))
    for m in range(int(cap), 1, -1):
        try:
            dims.check_batch(int(global_batch), m)
        except (MeshError, ZeroDivisionError):  # a mesh the pre-flight refuses anyway
            continue
        return m
    return 1


# A name that becomes one directory level: letters, digits, '.', '_', '-', not starting with
# '.' or '-' (so never '..', a hidden file or an option), at most 100 characters.
SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")


def is_safe_name(name: Any) -> bool:
    return isinstance(name, str) and SAFE_NAME.fullmatch(name) is not None


def _path_part(name: Any) -> str:
    """`name` as it appears in the arm directory's path: unchanged when safe; otherwise a
    harmless stand-in inside the sweep directory (the pre-flight then refuses the run and
    removes it), since Hydra creates the job's directory before moe_perf's code runs."""
    text = str(name)
    return text if is_safe_name(text) else "_" + re.sub(r"[^A-Za-z0-9._-]", "_", text)[:99]


def _current_branch(repo: str) -> Optional[str]:  # noqa: UP045
    return git.current_branch(repo)


def register() -> None:
    store = ConfigStore.instance()
    store.store(name="moe_perf_schema", node=MoePerfConfig)
    for group, options in OPTION_SCHEMAS.items():
        for option, schema in options.items():
            store.store(group=f"moe_perf_schema/{group}", name=option, node=schema)
    OmegaConf.register_new_resolver("moe_perf.tag", _tag, replace=True)
    OmegaConf.register_new_resolver("moe_perf.routing_tag", tag_suffix, replace=True)
    OmegaConf.register_new_resolver("moe_perf.repeat_suffix", repeat_suffix, replace=True)
    OmegaConf.register_new_resolver("moe_perf.path_part", _path_part, replace=True)
    OmegaConf.register_new_resolver("moe_perf.micro_batch_upto", micro_batch_upto, replace=True)
    # Evaluated per job; the runner replaces `refs` by what the sweep resolved at its start.
    OmegaConf.register_new_resolver("moe_perf.current_branch", _current_branch, replace=True)
    # --help's list of groups and options (conf/hydra/help/moe_perf.yaml)
    OmegaConf.register_new_resolver("moe_perf.option_groups", presets.option_groups, replace=True)


register()
