"""`python -m moe_perf list`: every shipped preset in one line, read from the option files.

A model shows what decides its cost (layers, experts, top-k, hidden); a mesh its layout (world,
pp/cp/ep, the inferred dp) and where it is meant to run; the other groups list their options.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from hydra.core.config_loader import ConfigLoader
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from moe_perf.common.mesh import MeshDims

# A world of up to 4 ranks runs on a CPU in the tests; the larger meshes are sized for GPUs.
CPU_WORLD = 4
OTHER_GROUPS = ("dtype", "trainer", "launcher", "arm")
# Hydra's own groups, and the typed schema's (runner/schema.py): no option for a user to pick
INTERNAL_GROUPS = ("hydra", "moe_perf_schema")


def conf_root(config_dir: str) -> Path:
    """The directory behind `config_dir()`: a path, or `pkg://moe_perf.conf`."""
    if config_dir.startswith("pkg://"):
        return Path(str(resources.files(config_dir.removeprefix("pkg://"))))
    return Path(config_dir)


def model_line(path: Path) -> str:
    m = OmegaConf.load(path)
    return (f"{path.stem:<18} {m.num_layers:>3} layers  {m.num_experts:>3} experts  "
            f"top-{m.top_k}  hidden {m.hidden}")  # fmt: skip


def mesh_line(path: Path) -> str:
    m = OmegaConf.load(path)
    dims = MeshDims(world=int(m.nnodes) * int(m.nproc_per_node), pp=m.pp, cp=m.cp, ep=m.ep)
    where = "CPU or GPU" if dims.world <= CPU_WORLD else "GPU"
    if m.nnodes > 1:
        where += f", {m.nnodes} nodes x {m.nproc_per_node}"
    return (f"{path.stem:<10} world {dims.world:>2}  pp{dims.pp} cp{dims.cp} ep{dims.ep}  "
            f"dp{dims.dp}  {where}")  # fmt: skip


# OmegaConf's merge dereferences --help's template, so Hydra evaluates the listing at every
# compose (each arm of a sweep, each in-process compose), though only --help shows it; each
# group's options cost Hydra a fresh config repository, about a third of a compose. A search
# path's groups and options do not change while a process runs: each is listed once.
_LISTED: dict[tuple[tuple[str | None, str | None], ...], str] = {}


def option_groups() -> str:
    """`group: option, ...` for every group a user selects, as Hydra's loader sees them (for
    --help: Hydra's own list, $APP_CONFIG_GROUPS, shows the typed schema's groups too)."""
    loader = GlobalHydra.instance().config_loader()
    search_path = tuple((e.provider, e.path) for e in loader.get_search_path().get_path())
    if search_path not in _LISTED:
        _LISTED[search_path] = _listed_groups(loader)
    return _LISTED[search_path]


def _listed_groups(loader: ConfigLoader) -> str:
    groups = sorted(g for g in loader.list_groups("") if g not in INTERNAL_GROUPS)
    return "\n".join(f"{g}: {', '.join(sorted(loader.get_group_options(g)))}" for g in groups)


def listing(config_dir: str) -> str:
    root = conf_root(config_dir)
    lines = ["model (python -m moe_perf model=NAME):"]
    lines += ["  " + model_line(p) for p in sorted((root / "model").glob("*.yaml"))]
    lines += ["", "mesh (mesh=NAME; dp = world / (pp*cp), inferred):"]
    lines += ["  " + mesh_line(p) for p in sorted((root / "mesh").glob("*.yaml"))]
    lines.append("")
    for group in OTHER_GROUPS:
        names = ", ".join(p.stem for p in sorted((root / group).glob("*.yaml")))
        lines.append(f"{group}: {names}")
    return "\n".join(lines) + "\n"
