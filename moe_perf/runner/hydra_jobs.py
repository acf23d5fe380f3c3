"""A sweep as Hydra sees it: this job, the sweep directory, every job's overrides, and every
job's prerequisites checked before the first arm launches.

The task (runner/app.py) and the sweep-start callback (runner/session.py) both read a sweep
through these functions; neither imports the other.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import hydra
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from moe_perf.common.errors import PrerequisiteError
from moe_perf.runner import pairs, preflight
from moe_perf.runner.job import Job


def sweep_dir_of(hydra_cfg: Any) -> Path:
    """The sweep directory as an absolute path, from Hydra's own node (`cfg.hydra` or
    `HydraConfig.get()`): a relative `hydra.sweep.dir` is relative to the launch cwd."""
    sweep_dir = Path(str(hydra_cfg.sweep.dir))
    if sweep_dir.is_absolute():
        return sweep_dir
    cwd = OmegaConf.select(hydra_cfg, "runtime.cwd", default=None)
    return (Path(str(cwd)) if cwd else Path.cwd()) / sweep_dir


def current_job(max_pairs: int = 0) -> Job:
    """The job Hydra is running now: its directories, number and overrides."""
    hc = HydraConfig.get()
    job = Job(
        arm_dir=Path(hc.runtime.output_dir),
        sweep_dir=sweep_dir_of(hc),
        cwd=Path(hc.runtime.cwd),
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

    False when the sweep's jobs cannot be listed (a sweeper other than the basic one, or no
    Hydra app running): then each job checks itself.
    """
    if not job.multirun or not GlobalHydra.instance().is_initialized():
        return False
    all_overrides = sweep_job_overrides(job, multirun)
    if all_overrides is None:
        return False
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
