"""The command: `python -m moe_perf [overrides] [-m arm=base,feat ...]`, one Hydra job per arm.

`hydra_main` is a thin shell around `runner.arm.run_arm(cfg, ...)`. In a multirun every job of
the sweep is checked before any arm launches (runner/hydra_jobs.py). `main()` makes the
command's one `SweepSession` and serves it while Hydra runs (runner/session.py).
`python -m moe_perf list` prints the presets; `--help` is Hydra's, with moe_perf's own page
(conf/hydra/help/moe_perf.yaml).

Exit codes: 0 every arm ok; 1 a config Hydra cannot compose; 2 a prerequisite failed before
anything launched; 3 the sweep ran and at least one arm failed (set after the comparison is
printed and written, runner/callback.py); 130 interrupted.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from moe_perf.common.errors import ARM_FAILED
from moe_perf.report.results.arm import ArmRecord
from moe_perf.runner import bisect, compile_cache, presets
from moe_perf.runner.arm import run_arm
from moe_perf.runner.hydra_jobs import current_job
from moe_perf.runner.job import say
from moe_perf.runner.session import SweepSession


def register_hydra_plugins() -> None:
    """Make moe_perf's sweeper and `hydra/launcher=moe_perf_slurm`'s class known to Hydra,
    however moe_perf is installed.

    Hydra 1.3 finds plugins by walking the `hydra_plugins` namespace on disk, which misses
    packages of a PEP 660 editable install (`pip install -e .`, setuptools >= 64; Hydra issue
    2359); it offers `Plugins.register` for this. The launcher needs the `slurm` extra.
    """
    from hydra.core.plugins import Plugins

    from hydra_plugins.moe_perf_sweeper.pairs_sweeper import PairsSweeper

    Plugins.instance().register(PairsSweeper)
    try:
        from hydra_plugins.moe_perf_launcher.sequential_slurm import SequentialSlurmLauncher
    except ImportError:  # no hydra-submitit-launcher: hydra/launcher=moe_perf_slurm can't compose
        return
    Plugins.instance().register(SequentialSlurmLauncher)


def config_dir() -> str:
    """The configs of the moe_perf that is running: `conf/` of its source tree when it runs
    from one (a checkout on PYTHONPATH, an editable install), else the installed package's
    `moe_perf.conf`. Resolving `pkg://moe_perf.conf` alone would fail without an install, and
    with an editable install elsewhere it would mix that tree's configs with this code."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "conf" / "config.yaml").is_file():
        return str(root / "conf")
    return "pkg://moe_perf.conf"


def one_arm_note(record: ArmRecord, overrides: list[str]) -> str:
    """A run without -m measures one arm: say so, and give the command that compares."""
    kept = [o for o in overrides if not o.lstrip("+~").startswith(("arm=", "repeat="))]
    command = " ".join(["python -m moe_perf", *kept, "-m", "arm=base,feat"])
    return (f"measured one arm ({record.arm}) and compared nothing; to compare base and feat "
            f"run the sweep: {command}")  # fmt: skip


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def hydra_main(cfg: DictConfig) -> None:
    job = current_job(int(OmegaConf.select(cfg, "compare.max_pairs", default=0) or 0))
    record = run_arm(cfg, job, SweepSession.of_command())
    if job.multirun or bool(cfg.get("dry_run", False)):
        return  # a multirun's exit code is set once the comparison is written (callback.py)
    say(one_arm_note(record, job.overrides))
    if not record.ok:
        sys.exit(ARM_FAILED)


def flags_first(argv: list[str]) -> list[str]:
    """`model=x -m arm=base,feat` as users type it: Hydra's parser wants -m before overrides."""
    flags = [arg for arg in argv if arg in ("-m", "--multirun")]
    return flags + [arg for arg in argv if arg not in ("-m", "--multirun")]


def main() -> None:
    """The `moe-perf` console script and `python -m moe_perf`."""
    compile_cache.keep_runner_bytecode()  # the console script's imports so far were compiled
    compile_cache.start_bytecode_pool()  # where `python -m moe_perf` did not start it already
    if sys.argv[1:] == ["list"]:
        print(presets.listing(config_dir()), end="")
        return
    if sys.argv[1:2] == ["bisect"]:
        sys.exit(bisect.main(sys.argv[2:]))
    register_hydra_plugins()
    sys.argv[1:] = flags_first(sys.argv[1:])
    try:
        with SweepSession().serving():
            hydra_main()
    except KeyboardInterrupt:
        say("interrupted: the running arm was stopped and the sweep's worktrees removed; the "
            "sweep stopped there", sys.stderr)  # fmt: skip
        sys.exit(130)
