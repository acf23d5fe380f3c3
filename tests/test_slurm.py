"""SLURM: `launcher=slurm` (arms as srun steps in an allocation) and
`hydra/launcher=moe_perf_slurm` (one job per arm), against a real single-node SLURM.

The `slurm` tests need a reachable SLURM (slurmctld/slurmd/munge running) and the `slurm`
extra; without either they are skipped, saying how to get it. The tests never install packages
or start daemons themselves: `.ci/setup_slurm.sh` (root) starts a single-node test cluster, and
`.ci/run` runs it before the tests and stops it after.
The A/B sweeps use the small-trainer repositories of tests/helpers/repos.py, whose feature
branch is slower per step, and are checked against the same sweep run locally: same layout, same
records, same comparison.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.command import SMALL_RUN, moe_perf, sweep_dir
from helpers.repos import git, make_ab_repo, trainer_files

from moe_perf.launchers import slurm

ROOT = Path(__file__).resolve().parents[1]
MESH = "ep2"  # two ranks per node: torchrun really spawns a group under srun
TAG = "pp1-dp2-cp1-ep2-seq64-fp32"
AB = [*SMALL_RUN, f"mesh={MESH}", "-m", "arm=base,feat"]
USABLE_STATES = ("idle", "mixed", "allocated", "completing")


# ---- the cluster -----------------------------------------------------------------------------


def _run(argv: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                          **kwargs)  # fmt: skip


def slurm_problem() -> str | None:
    """Why SLURM cannot run a job here, or None when `srun` works."""
    for tool in ("sinfo", "srun", "salloc", "sbatch", "scontrol"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    try:
        # a primary controller that is down is named by a ping at once, where sinfo retries
        # for about 10 s before it fails (a backup's state is no reason to skip)
        ping = _run(["scontrol", "ping"], timeout=20)
        down = [line for line in ping.stdout.splitlines() if "(primary)" in line and "DOWN" in line]
        if down:
            return f"scontrol ping: {down[0].strip()}"
        info = _run(["sinfo", "--noheader", "--format=%T"], timeout=20)
        if info.returncode != 0:
            return f"sinfo failed: {(info.stderr or info.stdout).strip()}"
        states = info.stdout.split()
        if not any(state.rstrip("*~#") in USABLE_STATES for state in states):
            return f"no usable node (sinfo states: {states or 'none'})"
        probe = _run(["srun", "--nodes=1", "--immediate=30", "true"], timeout=60)
        if probe.returncode != 0:
            return f"`srun true` failed: {(probe.stderr or probe.stdout).strip()}"
    except subprocess.TimeoutExpired as err:
        return f"timed out: {err}"
    return None


START_CLUSTER = (
    "start a single-node test cluster with `sudo bash .ci/setup_slurm.sh` (installs slurm-wlm "
    "and munge, starts the daemons; `sudo bash .ci/setup_slurm.sh --stop` stops them), or run "
    "the tests on a machine of a SLURM cluster"
)


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    problem = slurm_problem()
    if problem:
        pytest.skip(f"SLURM unavailable: {problem}; {START_CLUSTER}")


def require_submitit_launcher() -> None:
    try:
        import hydra_plugins.hydra_submitit_launcher  # noqa: F401
    except ImportError:
        pytest.skip("hydra-submitit-launcher is not installed: .venv/bin/pip install -e "
                    "'.[dev,slurm]' (the README's setup command)")  # fmt: skip


def without_slurm_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}


# ---- the sweeps ------------------------------------------------------------------------------


def records(repo: Path) -> dict[str, dict]:
    arms = sweep_dir(repo) / "tiny"
    return {arm: json.loads((arms / f"{TAG}-{arm}" / "metrics.json").read_text())
            for arm in ("base", "feat")}  # fmt: skip


def comparison(repo: Path) -> dict:
    return json.loads((sweep_dir(repo) / "comparison.json").read_text())


def layout(repo: Path) -> list[str]:
    """Files of the arm directories; torchrun's per-agent directory names are run ids."""
    arms = sweep_dir(repo) / "tiny"
    paths = set()
    for path in arms.rglob("*"):
        if path.is_file():
            parts = path.relative_to(arms).parts
            if len(parts) > 2 and parts[1] == "torchrun":
                parts = (*parts[:2], "<run>", *parts[3:])
            paths.add("/".join(parts))
    return sorted(paths)


def portable_config(record: dict, repo: Path) -> dict:
    """The arm's config without its launcher, the repository's path replaced by `<repo>`."""
    config = {k: v for k, v in record["config"].items() if k != "launcher"}
    return json.loads(json.dumps(config).replace(str(repo), "<repo>"))


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def assert_same_as_local(repo: Path, local: Path, launcher: str) -> None:
    """The records, layout and comparison of a SLURM sweep are those of the local sweep."""
    assert layout(repo) == layout(local)
    got, want = records(repo), records(local)
    for arm in ("base", "feat"):
        rec, ref = got[arm], want[arm]
        assert set(rec) == set(ref)
        assert rec["status"] == "ok", rec["failure"]
        for key in ("schema", "model", "tag", "arm", "ref", "exit_code", "failure"):
            assert rec[key] == ref[key], key
        assert rec["sha"] == git(repo, "rev-parse", {"base": "main", "feat": "feature"}[arm])
        assert [s["step"] for s in rec["steps"]] == [s["step"] for s in ref["steps"]]
        assert rec["environment"]["world_size"] == 2
        # the configs differ only where the two sweeps do: the launcher and the repository
        assert portable_config(rec, repo) == portable_config(ref, local)
        assert rec["config"]["launcher"]["name"] == launcher
    assert got["base"]["sweep_id"] == got["feat"]["sweep_id"]
    assert got["base"]["finished"] <= got["feat"]["started"]  # one after the other, base first

    (group,), (local_group,) = comparison(repo)["groups"], comparison(local)["groups"]
    assert (group["model"], group["tag"], group["status"]) == ("tiny", TAG, "compared")
    assert set(group["arms"]) == set(local_group["arms"]) == {"base", "feat"}
    assert group["config_differences"] == []
    # the feature branch sleeps 50 ms more per step: slower under every launcher
    for report in (group, local_group):
        assert report["difference"]["step_time_s"]["words"] == "slower"
    assert git(repo, "status", "--porcelain") == ""
    assert len(git(repo, "worktree", "list").splitlines()) == 1


@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory) -> Path:
    """The reference: the same A/B sweep with launcher=local."""
    repo = make_ab_repo(tmp_path_factory.mktemp("local") / "repo")
    assert_ok(moe_perf(repo, *AB))
    return repo


def in_allocation(how: str, repo: Path, *args: str, timeout: float = 240):
    """`python -m moe_perf ARGS` inside a fresh one-node allocation (salloc or sbatch)."""
    command = [sys.executable, "-m", "moe_perf", *args]
    if how == "salloc":
        argv = ["salloc", "--nodes=1", "--time=10", "--job-name=moe_perf-test", *command]
        return _run(argv, timeout=timeout, cwd=repo)
    out = repo.parent / "sbatch.out"  # outside the repository: its tree must stay clean
    argv = ["sbatch", "--wait", "--nodes=1", "--time=10", "--job-name=moe_perf-test",
            f"--output={out}", f"--chdir={repo}", f"--wrap={shlex.join(command)}"]  # fmt: skip
    result = _run(argv, timeout=timeout, cwd=repo)
    # the sweep's own output went to the job's output file: hand it back as stdout
    stdout = out.read_text() if out.exists() else ""
    return subprocess.CompletedProcess(argv, result.returncode, stdout, result.stderr)


# ---- without a cluster -----------------------------------------------------------------------


def test_srun_wraps_torchrun_with_rendezvous_on_the_first_node(monkeypatch):
    monkeypatch.setattr(slurm, "head_node", lambda nodelist: "node01")
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_JOB_NUM_NODES": "2"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc-per-node", "8", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", "localhost:12345", "--log-dir", "/arm/torchrun",
                "-m", "moe_perf.trainer", "/arm/config.yaml"]  # fmt: skip
    launcher = {"name": "slurm", "time_limit_min": 30, "extra_args": ["--exclusive"]}
    argv = slurm.srun_argv(torchrun, nnodes=2, arm_label="tag-base", launcher=launcher, env=env)
    cut = argv.index(sys.executable)
    srun, inner = argv[:cut], argv[cut:]
    assert srun[0] == "srun"
    for flag in ("--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--wait=0",
                 "--kill-on-bad-exit=1", "--time=30", "--exclusive"):  # fmt: skip
        assert flag in srun
    assert "--overlap" not in srun
    assert inner[inner.index("--rdzv-endpoint") + 1] == f"node01:{29500 + 4242}"
    assert inner[inner.index("--rdzv-id") + 1] == "4242-tag-base"
    assert inner[inner.index("--nnodes") + 1] == "2"
    assert inner[-3:] == ["-m", "moe_perf.trainer", "/arm/config.yaml"]
    # from inside a step (srun --pty bash, submitit's srun) the new step must share its CPUs
    stepped = slurm.srun_argv(torchrun, nnodes=2, arm_label="x", launcher={},
                              env={**env, "SLURM_STEP_ID": "0"})  # fmt: skip
    assert "--overlap" in stepped


def test_allocation_prerequisites_name_the_fix():
    with pytest.raises(slurm.SlurmLaunchError, match="launcher=local"):
        slurm.allocation({})
    alloc = slurm.allocation({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1",
                              "SLURM_JOB_NODELIST": "vm"})  # fmt: skip
    with pytest.raises(slurm.SlurmLaunchError, match=r"mesh.nnodes=2.*salloc -N 2"):
        slurm.check_nodes(alloc, 2)
    slurm.check_nodes(alloc, 1)


def test_failure_reason_names_a_time_limit():
    # what slurmstepd printed when a step of this test cluster ran past `srun --time=1`
    tail = (
        "slurmstepd-vm: error: *** STEP 4.0 ON vm CANCELLED AT 2026-12-02T18:57:59 "
        "DUE TO TIME LIMIT ***"
    )
    assert "time limit" in slurm.failure_reason(143, tail)
    assert "cancelled" in slurm.failure_reason(143, tail.replace(" DUE TO TIME LIMIT", ""))
    assert slurm.failure_reason(1, "Traceback ...") is None
    assert slurm.failure_reason(0, tail) is None


@pytest.mark.slow
def test_launcher_slurm_outside_an_allocation_launches_nothing(ab_repo):
    result = subprocess.run(
        [sys.executable, "-m", "moe_perf", *AB[:-2], "launcher=slurm", *AB[-2:]],
        cwd=ab_repo, env=without_slurm_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "SLURM_JOB_ID is not set" in result.stderr and "launcher=local" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (sweep_dir(ab_repo) / "tiny").exists()


# ---- against the real SLURM ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.parametrize("how", ["salloc", "sbatch"])
def test_launcher_slurm_sweep_matches_local(slurm_cluster, local_sweep, tmp_path, how):
    repo = make_ab_repo(tmp_path / "repo")
    result = in_allocation(how, repo, *AB[:-2], "launcher=slurm", *AB[-2:])
    assert_ok(result)
    assert_same_as_local(repo, local_sweep, "slurm")
    for arm in ("base", "feat"):
        console = (sweep_dir(repo) / "tiny" / f"{TAG}-{arm}" / "console.log").read_text()
        assert console.startswith("# srun --nodes=1 ")  # the arm ran as an srun step
        assert "--rdzv-endpoint" in console and "[rank1]:" in console
        assert f"[{arm}] step 3/6" in result.stdout  # progress streamed as locally
    assert "# moe_perf comparison" in result.stdout


@pytest.mark.slow
@pytest.mark.slurm
def test_launcher_slurm_failed_step_is_a_failed_arm(slurm_cluster, tmp_path):
    repo = make_ab_repo(tmp_path / "repo", base=trainer_files(exit_after_step=2))
    result = in_allocation("salloc", repo, *AB[:-2], "launcher=slurm", *AB[-2:])
    # the sweep goes on past a failed arm, compares, then exits 3 (an arm failed)
    assert result.returncode == 3, result.stdout[-4000:] + result.stderr[-4000:]
    got = records(repo)
    assert got["base"]["status"] == "failed" and got["base"]["exit_code"] == 3  # the trainer's
    # every rank exits 3 at step 2; torchrun names the first it saw fail, either of the two
    assert re.match(r"trainer exited with code 3 \(rank [01]\)", got["base"]["failure"])
    assert "crashing on purpose" in Path(got["base"]["log"]).read_text()
    assert got["feat"]["status"] == "ok"
    (group,) = comparison(repo)["groups"]
    assert group["status"] == "incomplete"


@pytest.mark.slow
@pytest.mark.slurm
def test_submitit_sweep_matches_local(slurm_cluster, local_sweep, tmp_path):
    require_submitit_launcher()
    repo = make_ab_repo(tmp_path / "repo")
    submit = ["launcher=slurm", "hydra/launcher=moe_perf_slurm", "hydra.launcher.partition=debug"]
    result = subprocess.run(
        [sys.executable, "-m", "moe_perf", *AB[:-2], *submit, *AB[-2:]],
        cwd=repo, env=without_slurm_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert_ok(result)
    assert_same_as_local(repo, local_sweep, "slurm")
    # one SLURM job per arm, in order; the comparison printed by the submitting process
    jobs = sorted(int(p.name) for p in (sweep_dir(repo) / ".submitit").iterdir() if p.is_dir())
    assert len(jobs) == 2
    base_log = sweep_dir(repo) / ".submitit" / str(jobs[0]) / f"{jobs[0]}_0_log.out"
    assert "[moe_perf] base: ok" in base_log.read_text()
    assert "# moe_perf comparison" in result.stdout


@pytest.mark.slow
@pytest.mark.slurm
def test_submitit_prerequisite_failure_submits_nothing(slurm_cluster, ab_repo):
    require_submitit_launcher()
    submit = ["launcher=slurm", "hydra/launcher=moe_perf_slurm"]
    result = subprocess.run(
        [sys.executable, "-m", "moe_perf", *AB[:-2], *submit, "refs.base=no-such-branch",
         *AB[-2:]],
        cwd=ab_repo, env=without_slurm_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "refs.base=no-such-branch" in result.stderr and "nothing was submitted" in result.stderr
    assert not (sweep_dir(ab_repo) / ".submitit").exists()


# ---- set-up: the README's commands, .ci/run, no daemons from the tests -----------------------


def readme_commands() -> list[str]:
    """The one-line commands of the README's setup section's code blocks, in order."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Setup", 1)[1].split("\n## ", 1)[0]
    blocks = section.split("```")[1::2]
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_ci_runs_exactly_the_readme_setup_and_test_commands():
    setup, main_job, tests = readme_commands()
    assert setup.startswith("python3 -m venv .venv") and "'.[dev,slurm]'" in setup
    assert tests == ".venv/bin/python -m pytest -q -n 2"
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in ci if line and not line.startswith("#")]
    assert setup in commands and tests in commands
    assert commands.index(setup) < commands.index(tests) == len(commands) - 1
    # besides them: the shell's own lines and the SLURM test cluster, started and stopped
    others = [c for c in commands if c not in (setup, tests)]
    assert others == [
        "set -euo pipefail",
        'cd "$(dirname "$0")/.."',
        "if [[ $(id -u) == 0 ]] && bash .ci/setup_slurm.sh; then",
        "trap 'bash .ci/setup_slurm.sh --stop' EXIT",
        "else",
        'echo "[ci] no SLURM test cluster here (needs root); the slurm tests will skip"',
        "fi",
    ]


@pytest.mark.slow
def test_without_slurm_the_slurm_tests_skip_saying_how_to_start_a_cluster(tmp_path):
    bin_dir = tmp_path / "bin"  # git and python only: no sinfo/srun, no apt-get, no bash
    bin_dir.mkdir()
    for tool in ("git",):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "slurm", "-p", "no:cacheprovider",
         str(Path(__file__))],
        cwd=ROOT, env={**without_slurm_env(), "PATH": str(bin_dir)}, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "failed" not in out and "error" not in out.lower(), out[-3000:]
    assert "SLURM unavailable: `sinfo` is not installed; start a single-node test cluster with " \
           "`sudo bash .ci/setup_slurm.sh`" in out  # fmt: skip
    assert "passed" not in out  # every slurm test skipped
