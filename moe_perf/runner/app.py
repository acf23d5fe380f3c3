"""The command: `python -m moe_perf [overrides] [-m arm=base,feat ...]`, one Hydra job per arm.

`hydra_main` is a thin shell around `runner.arm.run_arm(cfg, ...)`. In a multirun the first job
checks every job of the sweep (composed here with Hydra's compose API) before any arm launches.
`python -m moe_perf list` prints the presets; `--help` is Hydra's, with moe_perf's own page
(conf/hydra/help/moe_perf.yaml).

Exit codes: 0 every arm ok; 1 a config Hydra cannot compose; 2 a prerequisite failed before
anything launched; 3 the sweep ran and at least one arm failed (set after the comparison is
printed and written, runner/callback.py); 130 interrupted.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import hydra
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from moe_perf.common.errors import PrerequisiteError
from moe_perf.runner import bisect, pairs, preflight, presets
from moe_perf.runner.arm import run_arm
from moe_perf.runner.job import Job, say
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


SESSION = SweepSession()  # one command, one session: its locks and the sweep its jobs join


ARM_FAILED = 3  # the exit code of a sweep that ran and has a failed arm


def current_job(max_pairs: int = 0) -> Job:
    hc = HydraConfig.get()
    cwd = Path(hc.runtime.cwd)
    sweep_dir = Path(str(hc.sweep.dir))
    job = Job(
        arm_dir=Path(hc.runtime.output_dir),
        sweep_dir=sweep_dir if sweep_dir.is_absolute() else cwd / sweep_dir,
        cwd=cwd,
        num=int(OmegaConf.select(hc, "job.num", default=0) or 0),
        multirun=hc.mode == RunMode.MULTIRUN,
        config_name=str(hc.job.config_name),
        overrides=list(hc.overrides.task),
    )
    job.total = sweep_total(job, max_pairs) if job.multirun else 1
    return job


def sweep_arguments(job: Job, multirun: DictConfig | None) -> tuple[str, list[str]] | None:
    """(the sweeper's class, the sweep's arguments: `hydra.sweeper.params` then the command
    line's overrides). `multirun`: the sweep's config (before Hydra writes multirun.yaml)."""
    if multirun is None:
        try:
            multirun = OmegaConf.load(job.sweep_dir / "multirun.yaml")
        except OSError:
            return None
    params = OmegaConf.select(multirun, "hydra.sweeper.params") or {}
    task = OmegaConf.select(multirun, "hydra.overrides.task")
    if task is None:
        return None
    arguments = [f"{k}={v}" for k, v in params.items()] + list(task)
    return str(OmegaConf.select(multirun, "hydra.sweeper._target_")), arguments


def sweep_total(job: Job, max_pairs: int) -> int | None:
    """How many arms the sweep runs, when that is known before it runs (not for repeat=auto)."""
    found = sweep_arguments(job, None)
    if found is None or not found[0].endswith("PairsSweeper"):
        return len(sweep_job_overrides(job) or []) or None
    try:
        plan = pairs.plan_of(found[1])
    except ValueError:
        return None
    if plan.auto:  # known only when one pair is all there can be
        return 2 * len(plan.cells) if max_pairs == 1 else None
    return sum(len(batch) for batch in pairs.fixed_batches(plan))


def sweep_job_overrides(job: Job, multirun: DictConfig | None = None) -> list[list[str]] | None:
    """Every distinct job's overrides: moe_perf's sweeper's one job per cell and arm
    (pairs.distinct_jobs), or the basic sweeper's cartesian product of the swept values, the
    first override varying slowest. None when another sweeper runs the sweep."""
    found = sweep_arguments(job, multirun)
    if found is None:
        return None
    sweeper, arguments = found
    if sweeper.endswith("PairsSweeper"):
        try:
            return pairs.distinct_jobs(pairs.plan_of(arguments))
        except ValueError as err:
            raise PrerequisiteError(str(err)) from None
    if "BasicSweeper" not in sweeper:
        return None
    choices = []
    for override in OverridesParser.create().parse_overrides(arguments):
        key = override.get_key_element()
        if override.is_sweep_override():
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([f"{key}={override.get_value_element_as_str()}"])
    return [list(job) for job in itertools.product(*choices)]


def check_all_jobs(job: Job, repo: Path, multirun: DictConfig | None = None) -> bool:
    """Every job's prerequisites, before the first arm launches (multirun only).

    False when the sweep's jobs cannot be listed (a sweeper other than the basic one).
    """
    all_overrides = sweep_job_overrides(job, multirun)
    if all_overrides is None or not GlobalHydra.instance().is_initialized():
        return False  # the job checks itself
    problems = []
    for overrides in all_overrides:
        try:
            job_cfg = hydra.compose(config_name=job.config_name, overrides=overrides)
            preflight.check_config(job_cfg)
            preflight.check_job(job_cfg, repo)
        except PrerequisiteError as err:
            problems.append(f"job [{' '.join(overrides)}]: {err}")
        except Exception as err:  # a value that does not compose: Hydra's own message
            problems.append(f"job [{' '.join(overrides)}]: {type(err).__name__}: {err}")
    if problems:
        raise PrerequisiteError(f"{len(problems)} job(s) of this sweep cannot run:\n  " +
                                "\n  ".join(problems))  # fmt: skip
    return True


def config_dir() -> str:
    """The configs of the moe_perf that is running: `conf/` of its source tree when it runs
    from one (a checkout on PYTHONPATH, an editable install), else the installed package's
    `moe_perf.conf`. Resolving `pkg://moe_perf.conf` alone would fail without an install, and
    with an editable install elsewhere it would mix that tree's configs with this code."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "conf" / "config.yaml").is_file():
        return str(root / "conf")
    return "pkg://moe_perf.conf"


def one_arm_note(record: dict, overrides: list[str]) -> str:
    """A run without -m measures one arm: say so, and give the command that compares."""
    kept = [o for o in overrides if not o.lstrip("+~").startswith(("arm=", "repeat="))]
    command = " ".join(["python -m moe_perf", *kept, "-m", "arm=base,feat"])
    return (f"measured one arm ({record['arm']}) and compared nothing; to compare base and feat "
            f"run the sweep: {command}")  # fmt: skip


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def hydra_main(cfg: DictConfig) -> None:
    job = current_job(int(OmegaConf.select(cfg, "compare.max_pairs", default=0) or 0))
    record = run_arm(cfg, job, SESSION, check_all_jobs)
    if job.multirun or bool(cfg.get("dry_run", False)):
        return  # a multirun's exit code is set once the comparison is written (callback.py)
    say(one_arm_note(record, job.overrides))
    if record["status"] != "ok":
        sys.exit(ARM_FAILED)


def flags_first(argv: list[str]) -> list[str]:
    """`model=x -m arm=base,feat` as users type it: Hydra's parser wants -m before overrides."""
    flags = [arg for arg in argv if arg in ("-m", "--multirun")]
    return flags + [arg for arg in argv if arg not in ("-m", "--multirun")]


def main() -> None:
    """The `moe-perf` console script and `python -m moe_perf`."""
    if sys.argv[1:] == ["list"]:
        print(presets.listing(config_dir()), end="")
        return
    if sys.argv[1:2] == ["bisect"]:
        sys.exit(bisect.main(sys.argv[2:]))
    register_hydra_plugins()
    sys.argv[1:] = flags_first(sys.argv[1:])
    try:
        hydra_main()
    except KeyboardInterrupt:
        say("interrupted: the running arm was stopped and the sweep's worktrees removed; the "
            "sweep stopped there", sys.stderr)  # fmt: skip
        sys.exit(130)
