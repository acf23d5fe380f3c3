"""`launcher=slurm`: each arm's torchrun runs as one `srun` step over the mesh's nodes.

The runner still owns everything else (worktree, config file, streaming, records): this module
only turns the local torchrun argument list into

    srun --nodes N --ntasks-per-node 1 -W 0 --kill-on-bad-exit 1 ... \\
        python -m torch.distributed.run --nnodes N --rdzv-backend c10d \\
            --rdzv-endpoint <first node of the allocation>:<port> --rdzv-id <job>-<arm> ...

run from the arm's worktree, inside an allocation the user already holds (`salloc`/`sbatch`).
srun forwards every node's output to its own stdout, so the console log and the progress are
read exactly as locally; torchrun's per-rank logs land under the arm's `torchrun/` (one
sub-directory per node agent: torchrun makes each unique). Needs a filesystem shared by the
nodes for the repository, its worktrees and the output directory, as any SLURM training does.

The Hydra submitit launcher behind `hydra/launcher=moe_perf_slurm`, which submits one job per
arm and waits for it before the next, lives in hydra_plugins/moe_perf_launcher (docs/slurm.md).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from moe_perf.common.bounds import knob
from moe_perf.common.errors import PrerequisiteError
from moe_perf.launchers.base import LauncherSchema, free_port, torchrun_argv


class SlurmLaunchError(RuntimeError):
    """`launcher=slurm` cannot run here; the message names the setting to change."""


# slurmstepd's words when `--time` (the step's or the job's) runs out.
_TIME_LIMIT = re.compile(r"CANCELLED AT \S+ DUE TO TIME LIMIT")
_STEP_CANCELLED = re.compile(
    r"\*\*\* (?:STEP|JOB) \S+ ON \S+ CANCELLED AT \S+(?: DUE TO (.+?))? \*\*\*"
)


def allocation(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The allocation this process runs in: job id, node count, node list.

    Raises SlurmLaunchError outside an allocation: launcher=slurm never submits a job itself.
    """
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        raise SlurmLaunchError(
            "launcher=slurm runs each arm as an srun step inside an existing allocation, and "
            "SLURM_JOB_ID is not set. Run the sweep inside `salloc -N <nodes> ...` or an sbatch "
            "script (docs/slurm.md), submit it with hydra/launcher=moe_perf_slurm, "
            "or use launcher=local to run on this machine."
        )
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    nnodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "0"
    return {"job_id": job_id, "nnodes": int(nnodes), "nodelist": nodelist}


def check_nodes(alloc: Mapping[str, Any], nnodes: int) -> None:
    """The allocation must have at least the mesh's nodes (srun would fail after a wait)."""
    if alloc["nnodes"] and alloc["nnodes"] < nnodes:
        raise SlurmLaunchError(
            f"the mesh needs mesh.nnodes={nnodes} nodes but allocation {alloc['job_id']} has "
            f"{alloc['nnodes']} ({alloc['nodelist']}): allocate with `salloc -N {nnodes}` "
            "(or `#SBATCH --nodes`), or choose a smaller mesh"
        )


def check_allocation(
    nnodes: int, env: Mapping[str, str] | None = None, *, submitting: bool = False
) -> None:
    """The prerequisite of launcher=slurm: inside an allocation with the mesh's nodes, srun here.

    Skipped in the process that submits the sweep with hydra/launcher=moe_perf_slurm: each arm
    gets its allocation from its own job, where this check runs again.
    """
    env = os.environ if env is None else env
    if submitting:
        return
    alloc = allocation(env)
    if not env.get("SUBMITIT_EXECUTOR"):
        # in a moe_perf_slurm job the sweep's first job also checks the later arms, whose jobs
        # are sized from their own meshes: only this arm's launch checks its node count
        check_nodes(alloc, nnodes)
    if shutil.which("srun") is None:
        raise SlurmLaunchError("launcher=slurm: `srun` is not on PATH; use launcher=local")


def head_node(nodelist: str) -> str:
    """The first host of a SLURM node list (`node[01-04]` -> `node01`): the rendezvous host."""
    if not nodelist:
        raise SlurmLaunchError("SLURM_JOB_NODELIST is empty: cannot pick the rendezvous node")
    proc = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=False
    )
    hosts = proc.stdout.split()
    if proc.returncode != 0 or not hosts:
        raise SlurmLaunchError(
            f"`scontrol show hostnames {nodelist}` failed: {proc.stderr.strip() or 'no hosts'}"
        )
    return hosts[0]


def rendezvous_port(job_id: str, configured: int | None) -> int:
    """`launcher.rdzv_port`, or a port derived from the job id (two jobs sharing a node differ).

    The runner cannot probe for a free port here: the head node may be another machine.
    """
    if configured:
        return int(configured)
    digits = re.sub(r"\D", "", job_id) or "0"
    return 29500 + int(digits) % 10000


def _set_option(argv: list[str], flag: str, value: str) -> list[str]:
    """argv with `flag value` (or `flag=value`) replaced, or inserted after the module name."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == flag and i + 1 < len(out):
            out[i + 1] = value
            return out
        if arg.startswith(flag + "="):
            out[i] = f"{flag}={value}"
            return out
    # insert before the first script/module argument of torchrun (after `-m torch.distributed.run`)
    at = _torchrun_options_start(out)
    return out[:at] + [flag, value] + out[at:]


def _torchrun_options_start(argv: Sequence[str]) -> int:
    for i, arg in enumerate(argv):
        if arg == "torch.distributed.run" or arg.endswith("torchrun"):
            return i + 1
    raise SlurmLaunchError(f"not a torchrun command line: {list(argv)!r}")


def step_name(arm_label: str) -> str:
    """The srun step's name: how `squeue --steps` shows it, and how it is cancelled."""
    return f"moe_perf:{arm_label}"


def srun_argv(
    torchrun_argv: Sequence[str],
    *,
    nnodes: int,
    arm_label: str,
    launcher: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """The srun command line that runs `torchrun_argv` once per node of the mesh.

    `torchrun_argv` is the local launch (python -m torch.distributed.run ... -m trainer cfg);
    its rendezvous is moved to the first node of the allocation, with an id unique to this arm,
    so the agents on every node meet there and ranks are assigned by the c10d rendezvous.
    """
    env = os.environ if env is None else env
    alloc = allocation(env)
    check_nodes(alloc, nnodes)
    head = head_node(alloc["nodelist"])
    port = rendezvous_port(alloc["job_id"], launcher.get("rdzv_port"))
    # one id per arm: a straggler of the previous arm can never join this rendezvous
    rdzv_id = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{alloc['job_id']}-{arm_label}")

    torchrun = list(torchrun_argv)
    torchrun = _set_option(torchrun, "--nnodes", str(nnodes))
    torchrun = _set_option(torchrun, "--rdzv-backend", "c10d")
    torchrun = _set_option(torchrun, "--rdzv-endpoint", f"{head}:{port}")
    torchrun = _set_option(torchrun, "--rdzv-id", rdzv_id)

    srun = [
        str(launcher.get("srun", "srun")),
        f"--nodes={nnodes}",
        f"--ntasks={nnodes}",
        "--ntasks-per-node=1",
        # -W 0: wait for every node's torchrun however long the others take;
        # --kill-on-bad-exit: one node failing ends the step instead of leaving the rest hanging
        "--wait=0",
        "--kill-on-bad-exit=1",
        "--unbuffered",
        f"--job-name={step_name(arm_label)}",
    ]
    if launcher.get("time_limit_min"):
        srun.append(f"--time={int(launcher['time_limit_min'])}")
    if launcher.get("cpus_per_task"):
        srun.append(f"--cpus-per-task={int(launcher['cpus_per_task'])}")
    if launcher.get("gpus_per_node"):
        srun.append(f"--gpus-per-node={int(launcher['gpus_per_node'])}")
    if env.get("SLURM_STEP_ID") is not None:
        # launched from inside a step (`srun --pty bash`, submitit's own srun): that step holds
        # the allocation's CPUs, and a new step must share them or it waits forever
        srun.append("--overlap")
    srun += [str(a) for a in launcher.get("extra_args") or ()]
    return srun + torchrun


def build_srun_argv(build_argv: Sequence[str], *, nnodes: int, every_node: bool,
                    arm_label: str, launcher: Mapping[str, Any],
                    env: Mapping[str, str] | None = None) -> list[str]:  # fmt: skip
    """The srun command line of an arm's build step: one task on one node of the allocation
    (a compute node, with the toolchain and GPUs the arm runs on; the worktree is on the
    filesystem the nodes share), or one per node of the mesh when the build writes to each
    node's own disk (`launcher.build_on_every_node`)."""
    env = os.environ if env is None else env
    nodes = nnodes if every_node else 1
    srun = [
        str(launcher.get("srun", "srun")),
        f"--nodes={nodes}",
        f"--ntasks={nodes}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        f"--job-name={step_name(arm_label)}:build",
    ]
    if launcher.get("cpus_per_task"):
        srun.append(f"--cpus-per-task={int(launcher['cpus_per_task'])}")
    if env.get("SLURM_STEP_ID") is not None:
        srun.append("--overlap")  # inside a step that holds the CPUs (see srun_argv)
    return srun + [str(a) for a in launcher.get("extra_args") or ()] + list(build_argv)


def failure_reason(returncode: int, console_tail: str) -> str | None:
    """A readable reason for a failed step, from srun's exit status and its last output."""
    if returncode == 0:
        return None
    if _TIME_LIMIT.search(console_tail):
        return (
            f"srun step hit its time limit (exit {returncode}): raise launcher.time_limit_min"
            " or the allocation's --time"
        )
    match = _STEP_CANCELLED.search(console_tail)
    if match:
        return f"srun step cancelled ({match.group(1) or 'scancel'}; exit {returncode})"
    return None


@dataclass
class SlurmLauncherSchema(LauncherSchema):
    name: str = "slurm"
    time_limit_min: Optional[int] = knob(None, min=1)  # noqa: UP045
    cpus_per_task: Optional[int] = knob(None, min=1)  # noqa: UP045
    gpus_per_node: Optional[int] = knob(None, min=0)  # noqa: UP045
    rdzv_port: Optional[int] = knob(None, min=1, max=65535)  # noqa: UP045
    extra_args: list[str] = field(default_factory=list)
    srun: str = "srun"  # the srun executable (tests point it at a wrapper)
    build_on_every_node: bool = False  # trainer.build once per node, not once (docs/build.md)


class SlurmLauncher:
    """`launcher=slurm`: the torchrun launch as one srun step over the mesh's nodes."""

    schema = SlurmLauncherSchema
    name = schema.name

    def check(self, cfg: Any, *, submitting: bool = False) -> None:
        try:
            check_allocation(int(cfg.mesh.nnodes), submitting=submitting)
        except SlurmLaunchError as err:
            raise PrerequisiteError(str(err)) from None

    def argv(self, cfg: Any, arm_dir: Path, trainer_argv: Sequence[str]) -> list[str]:
        # srun_argv moves the rendezvous to the first node of the allocation
        local = torchrun_argv(cfg, arm_dir, free_port()) + list(trainer_argv)
        return srun_argv(
            local, nnodes=int(cfg.mesh.nnodes), arm_label=arm_dir.name, launcher=cfg.launcher
        )

    def build_argv(self, cfg: Any, label: str, build_argv: Sequence[str]) -> list[str]:
        return build_srun_argv(
            build_argv,
            nnodes=int(cfg.mesh.nnodes),
            every_node=bool(cfg.launcher.get("build_on_every_node", False)),
            arm_label=label,
            launcher=cfg.launcher,
        )

    def one_process(self, cfg: Any) -> bool:
        return False  # always torchrun in an srun step: its rendezvous spans the nodes

    def env(self, cfg: Any) -> dict[str, str]:
        return {}

    def failure_reason(self, exit_code: int | None, console_tail: str) -> str | None:
        return failure_reason(exit_code or 1, console_tail)
