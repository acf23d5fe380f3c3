"""`hydra/launcher=moe_perf_slurm`: Hydra's submitit launcher, one arm per SLURM job, in order.

Stock `submitit_slurm` submits a whole sweep batch as one job array, so arms would run
concurrently (Hydra's submitit launchers run a batch's jobs at once; only
`hydra.sweeper.max_batch_size=1` keeps one job at a time, in order). This subclass submits one
job, waits for its result, then submits the next, whatever the sweeper's batch size: arms stay
strictly sequential and in sweep order (base before feat, repeats interleaved).

Per job it also sizes the request from that job's own composed config, so a sweep over meshes
gets the right allocation for each arm:
* `nodes` = `mesh.nnodes` (the arm's `launcher=slurm` srun spans them);
* `gpus_per_node` = `mesh.nproc_per_node` when the partition advertises GPUs (gres `gpu`) and
  the training device is not `cpu`, unless set explicitly; without it SLURM hides the GPUs;
* `timeout_min` at least the arm's `timeout_s` plus setup time, so SLURM never kills a job
  before the runner's own timeout can record the arm as failed.

The Python job runs in the batch script on the first node (`use_srun: false`), not in an srun
step over every node: the runner must run once per arm, and its own srun needs the nodes free.

The end-of-sweep comparison (Hydra's `on_multirun_end`) runs in the submitting process after
the last job, reading the metrics.json files the jobs wrote (a shared filesystem).
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn

from moe_perf.common.errors import PrerequisiteError
from moe_perf.runner import preflight
from moe_perf.runner.hydra_jobs import sweep_dir_of
from moe_perf.runner.outputs import ignore_outputs

try:  # the `slurm` extra; without it there is no launcher here (and no warning from Hydra's scan)
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
except ImportError:  # pragma: no cover - depends on the environment
    SlurmLauncher = None  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)

# minutes a job needs beyond the arm's training timeout: worktree, interpreter, torch import
SETUP_MARGIN_MIN = 10


def partition_has_gpus(partition: str | None) -> bool:
    """True when `sinfo` lists a gres of type gpu on the (default) partition."""
    cmd = ["sinfo", "--noheader", "--format=%G"]
    if partition:
        cmd.append(f"--partition={partition}")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    return proc.returncode == 0 and "gpu" in proc.stdout


def say(text: str) -> None:
    print(f"[moe_perf] {text}", file=sys.stderr, flush=True)


def check_before_submitting(job_cfgs: Sequence[Any], first_batch: bool, sweep_dir: Path) -> None:
    """The runner's prerequisites, checked here so a bad sweep submits nothing (exit 2).

    The same checks run again in each job (moe_perf.runner), which also takes the sweep lock
    and resolves the refs to SHAs: that needs the job's process, so it is not done here.
    """
    problems = []
    for job_cfg in job_cfgs:
        try:
            repo = preflight.find_repo(str(job_cfg.repo), Path.cwd())
            # Hydra has written multirun.yaml already: outputs must not count as a dirty tree
            ignore_outputs(repo, sweep_dir)
            if first_batch and not problems:
                preflight.check_sweep(repo, {"base": job_cfg.refs.base, "feat": job_cfg.refs.feat})
            # no allocation here yet: each job checks its own
            preflight.check_job(job_cfg, repo, submitting=True)
        except PrerequisiteError as err:
            problems.append(str(err))
    if problems:
        for problem in dict.fromkeys(problems):  # once each, in order
            say(f"cannot run: {problem}")
        say("nothing was submitted")
        raise SystemExit(2)


if SlurmLauncher is not None:

    class SequentialSlurmLauncher(SlurmLauncher):
        """submitit's SLURM launcher, one job at a time, each sized by its arm's mesh."""

        def __init__(self, **params: Any) -> None:
            super().__init__(**params)
            # submitit's own switch (slurm_use_srun): run the job's Python in the batch script
            self.params["use_srun"] = False
            self._gpus_configured = self.params.get("gpus_per_node")
            self._timeout_configured = int(self.params.get("timeout_min") or 0)

        def _job_config(self, overrides: Sequence[str]) -> Any:
            assert self.hydra_context is not None and self.config is not None
            loader = self.hydra_context.config_loader
            return loader.load_sweep_config(self.config, list(overrides))

        def _size_for(self, job_cfg: Any, overrides: Sequence[str]) -> None:
            nnodes = int(job_cfg.mesh.nnodes)
            nproc = int(job_cfg.mesh.nproc_per_node)
            self.params["nodes"] = nnodes
            self.params["tasks_per_node"] = 1
            gpus = self._gpus_configured
            if gpus is None and str(job_cfg.training.device) != "cpu":
                if partition_has_gpus(self.params.get("partition")):
                    gpus = nproc
            self.params["gpus_per_node"] = gpus
            arm_min = math.ceil(float(job_cfg.timeout_s) / 60) + SETUP_MARGIN_MIN
            self.params["timeout_min"] = max(self._timeout_configured, arm_min)
            log.info(
                f"SLURM job: nodes={nnodes} gpus_per_node={gpus} "
                f"timeout_min={self.params['timeout_min']} ({' '.join(overrides)})"
            )

        def launch(
            self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
        ) -> Sequence[JobReturn]:
            job_cfgs = [self._job_config(overrides) for overrides in job_overrides]
            assert self.config is not None
            sweep_dir = sweep_dir_of(self.config.hydra)
            check_before_submitting(job_cfgs, initial_job_idx == 0, sweep_dir)
            returns: list[JobReturn] = []
            jobs = zip(job_overrides, job_cfgs, strict=True)
            for offset, (overrides, job_cfg) in enumerate(jobs):
                self._size_for(job_cfg, overrides)
                # one job per call: super().launch submits it and blocks until its result
                try:
                    returns.extend(super().launch([overrides], initial_job_idx + offset))
                except Exception as err:  # submitit's FailedJobError / UncompletedJobError
                    # the runner records failed arms and returns normally: a job that raised
                    # stopped on purpose (a prerequisite, Ctrl-C) or was killed by SLURM
                    last = str(err).strip().splitlines()[-1:] or [type(err).__name__]
                    say(f"SLURM job of [{' '.join(overrides)}] did not finish: {last[0]}")
                    say(f"its logs: {self.config.hydra.sweep.dir}/.submitit/; the sweep is stopped")
                    raise SystemExit(1) from None
            return returns
