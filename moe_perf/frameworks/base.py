"""The interface of a framework adapter: what one arm runs under torchrun, and how to read it.

An adapter turns the composed config of an arm into the trainer's own command line (the part
after `python -m torch.distributed.run <flags>`), the environment it adds, and the format of
the per-step lines the trainer prints. The runner owns everything else: worktree, launch,
streaming, records. One module per framework; `frameworks.get(cfg)` picks it by
`trainer.name`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from moe_perf.common.bounds import knob


@dataclass(frozen=True)
class TrainerLaunch:
    argv: list[str]  # after `python -m torch.distributed.run ...`: ["-m", "pkg.train", ...]
    env: dict[str, str] = field(default_factory=dict)  # added to the runner's environment
    # "contract" | "torchtitan" | "megatron" | "nemo" | a regex with named groups
    log_format: str = "contract"


@dataclass
class BuildKeys:
    """Every trainer option's build step: a command run in the arm's worktree before its
    launch, once per commit (moe_perf/runner/build.py, docs/build.md)."""

    build: list[str] = field(default_factory=list)  # empty: nothing to build
    build_cache: str = "off"  # off | auto | a directory: reuse builds across sweeps
    build_timeout_s: float = knob(3600.0, above=0)
    # modules whose file and hash each arm's record names (the trainer's own package always)
    verify_imports: list[str] = field(default_factory=list)


class Framework(Protocol):
    name: str  # trainer=<name>: its schema's `name`
    schema: type  # the option's Hydra schema (a dataclass with BuildKeys' fields)

    def check(self, cfg: Any, repo: Path) -> None:
        """Raises PrerequisiteError (one line, naming the setting) before anything launches."""

    def launch(self, cfg: Any, arm_dir: Path, config_path: Path, worktree: Path) -> TrainerLaunch:
        """The arm's trainer command; `config_path` is the resolved config the runner wrote."""
