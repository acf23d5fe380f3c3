"""`hydra/launcher=moe_perf_slurm`: Hydra's submitit launcher, one arm per SLURM job, in order.

Stock `submitit_slurm` submits a whole sweep batch as one job array, so arms would run
concurrently (unless `hydra.sweeper.max_batch_size=1`, REFERENCE §7). This subclass submits one
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
from collections.abc import Sequence
from typing import Any

from hydra.core.utils import JobReturn
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher

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


class SequentialSlurmLauncher(SlurmLauncher):
    """submitit's SLURM launcher, one job at a time, each sized by its arm's mesh."""

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        # submitit's own switch (slurm_use_srun): run the job's Python in the batch script
        self.params["use_srun"] = False
        self._gpus_configured = self.params.get("gpus_per_node")
        self._timeout_configured = int(self.params.get("timeout_min") or 0)

    def _size_for(self, overrides: Sequence[str]) -> None:
        assert self.hydra_context is not None and self.config is not None
        job_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
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
        returns: list[JobReturn] = []
        for offset, overrides in enumerate(job_overrides):
            self._size_for(overrides)
            # one job per call: super().launch submits and blocks until its result is back
            returns.extend(super().launch([overrides], initial_job_idx + offset))
        return returns
