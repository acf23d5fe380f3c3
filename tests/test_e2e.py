"""End to end: the real `python -m moe_perf ... -m arm=base,feat` in temporary git repositories
whose feature branch is measurably slower per step. No mocks: real Hydra, git, torchrun, torch.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.command import SMALL_RUN, assert_ok, moe_perf, processes_mentioning, sweep_dir
from helpers.repos import copy_of_moe_perf, git, make_ab_repo, make_repo, trainer_files

from moe_perf.runner import git as gitops

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
TAG = "pp1-dp1-cp1-ep1-seq64-fp32"


def record(arm_dir: Path) -> dict:
    return json.loads((arm_dir / "metrics.json").read_text())


def comparison(repo: Path) -> dict:
    return json.loads((sweep_dir(repo) / "comparison.json").read_text())


def assert_repo_untouched(repo: Path) -> None:
    assert git(repo, "status", "--porcelain") == ""  # outputs/ ignored, nothing left behind
    assert len(git(repo, "worktree", "list").splitlines()) == 1


@pytest.fixture(scope="module")
def two_mesh_sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, dict]:
    """One real `-m mesh=single,ep2 arm=base,feat` sweep (feat sleeps 0.05 s more per step),
    read by the two tests below: (repository, result, each arm's commit)."""
    repo = make_ab_repo(tmp_path_factory.mktemp("two-mesh") / "repo", slowdown_s=0.05)
    shas = {"base": git(repo, "rev-parse", "main"), "feat": git(repo, "rev-parse", "feature")}
    # each base arm moves the user's checkout to main: feat must still run the commit that was
    # checked out when the sweep started
    result = moe_perf(repo, *SMALL_RUN, "-m", "mesh=single,ep2", "arm=base,feat",
                      env={"TEST_SWITCH_USER_BRANCH_TO": "main"})  # fmt: skip
    assert_ok(result)
    return repo, result, shas


def test_ab_sweep_feat_is_slower(two_mesh_sweep):
    repo, result, shas = two_mesh_sweep
    assert git(repo, "branch", "--show-current") == "main"

    arms = sweep_dir(repo) / "tiny"
    for arm in ("base", "feat"):
        arm_dir = arms / f"{TAG}-{arm}"
        assert (arm_dir / "config.yaml").is_file() and (arm_dir / "console.log").is_file()
        # one process runs without torchrun (no per-rank logs) and without a process group
        assert not (arm_dir / "torchrun").exists()
        rec = record(arm_dir)
        assert rec["environment"]["world_size"] == 1
        assert rec["schema"] == "moe_perf.arm/2" and rec["status"] == "ok"
        assert (rec["model"], rec["tag"], rec["arm"], rec["exit_code"]) == ("tiny", TAG, arm, 0)
        assert rec["sha"] == shas[arm]
        assert rec["ref"] == {"base": "main", "feat": "feature"}[arm]
        assert [s["step"] for s in rec["steps"]] == [1, 2, 3, 4, 5, 6]
        # 6 steps: too few to judge settling, so step 1 alone is dropped
        assert rec["summary"]["steps_measured"] == 5 and rec["summary"]["steps_settling"] == 0
        assert rec["summary"]["settled"] is True
        assert rec["environment"]["world_size"] == 1 and rec["environment"]["torch"]
        assert rec["config"]["training"]["max_steps"] == 6
        assert f"[{arm}] step 3/6" in result.stdout
    base, feat = record(arms / f"{TAG}-base"), record(arms / f"{TAG}-feat")
    assert base["sweep_id"] == feat["sweep_id"]
    assert base["finished"] <= feat["started"]  # strictly one after the other, base first
    assert feat["summary"]["step_time_s"] > base["summary"]["step_time_s"] + 0.03

    (group,) = [g for g in comparison(repo)["groups"] if g["tag"] == TAG]
    assert group["status"] == "compared" and group["config_differences"] == []
    assert group["difference"]["step_time_s"]["words"] == "slower"
    assert group["difference"]["step_time_s"]["pct"] > 0
    assert "A/A" not in result.stdout
    assert_repo_untouched(repo)
    # the sweep directory ignores itself; nothing above it is hidden from git
    assert (sweep_dir(repo) / ".gitignore").read_text().strip().endswith("*")
    assert not (repo / "outputs" / ".gitignore").exists()


def test_two_meshes_give_two_comparisons(two_mesh_sweep):
    ab_repo, result, _ = two_mesh_sweep
    groups = {g["tag"]: g for g in comparison(ab_repo)["groups"]}
    assert set(groups) == {TAG, "pp1-dp2-cp1-ep2-seq64-fp32"}
    for group in groups.values():
        assert group["difference"]["step_time_s"]["words"] == "slower"
    ep2 = record(sweep_dir(ab_repo) / "tiny" / "pp1-dp2-cp1-ep2-seq64-fp32-base")
    assert ep2["environment"]["world_size"] == 2
    ep2_dir = Path(ep2["arm_dir"])
    assert len(list((ep2_dir / "torchrun").rglob("stdout.log"))) == 2
    assert "[rank1]:rank 1 done" in (ep2_dir / "console.log").read_text()  # all ranks saved
    assert "rank 1 done" not in result.stdout and "rank 0 done" in result.stdout  # rank 0 shown
    assert "[base] step 2/6" in result.stdout  # ...rank 0 shown


def test_repeats_interleave_and_show_the_spread(ab_repo):
    result = moe_perf(ab_repo, *SMALL_RUN, "-m", "repeat=0,1", "arm=base,feat")
    assert_ok(result)
    arms = sweep_dir(ab_repo) / "tiny"
    names = [f"{TAG}-{arm}-r{r}" for r in (0, 1) for arm in ("base", "feat")]
    starts = [record(arms / name)["started"] for name in names]
    # ABBA: base r0, feat r0, then feat r1 before base r1
    assert starts[0] < starts[1] < starts[3] < starts[2]
    (group,) = comparison(ab_repo)["groups"]
    for arm in ("base", "feat"):
        stat = group["arms"][arm]["step_time_s"]
        assert group["arms"][arm]["runs_ok"] == 2
        assert stat["min"] <= stat["median"] <= stat["max"]
    assert group["difference"]["step_time_s"]["within_spread"] is False
    assert_repo_untouched(ab_repo)


def test_single_run_and_earlier_runs_are_kept(ab_repo):
    first = moe_perf(ab_repo, *SMALL_RUN, "arm=base")
    assert_ok(first)
    arm_dir = sweep_dir(ab_repo) / "tiny" / f"{TAG}-base"
    first_id = record(arm_dir)["sweep_id"]
    assert not (sweep_dir(ab_repo) / "comparison.json").exists()  # one arm: nothing to compare
    second = moe_perf(ab_repo, *SMALL_RUN, "arm=base")
    assert_ok(second)
    kept = sweep_dir(ab_repo) / "previous" / first_id / "tiny" / f"{TAG}-base"
    assert record(kept)["sweep_id"] == first_id
    assert record(arm_dir)["sweep_id"] != first_id
    assert_repo_untouched(ab_repo)


def test_failed_arms_are_recorded_and_the_sweep_goes_on(tmp_path):
    crash, hang = trainer_files(exit_after_step=2), trainer_files(sleep_s=600)
    repo = make_ab_repo(tmp_path / "repo", base=crash, feat=hang)
    result = moe_perf(repo, *SMALL_RUN, "timeout_s=10", "launcher.kill_grace_s=2", "-m",
                      "arm=base,feat")  # fmt: skip
    # failed arms do not stop the sweep: the comparison still runs, then the exit code is 3
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    assert (sweep_dir(repo) / "comparison.md").is_file()
    arms = sweep_dir(repo) / "tiny"
    base, feat = record(arms / f"{TAG}-base"), record(arms / f"{TAG}-feat")
    # one process, launched without torchrun: its exit status is the trainer's own
    assert (base["status"], base["exit_code"], base["launch_exit_code"]) == ("failed", 3, 3)
    assert "trainer exited with code 3 (rank 0)" in base["failure"] and len(base["steps"]) == 2
    assert "crashing on purpose" in Path(base["log"]).read_text()
    assert feat["status"] == "failed" and "timed out after 10 s" in feat["failure"]
    assert "FAILED" in result.stderr and feat["log"] in result.stderr
    (group,) = comparison(repo)["groups"]
    assert {run["status"] for run in group["runs"]} == {"failed"}
    assert processes_mentioning(str(repo)) == []
    assert_repo_untouched(repo)


def test_arms_with_different_configs_are_refused(ab_repo):
    result = moe_perf(ab_repo, *SMALL_RUN, "-m", "arm=base,feat", "training.seed=1,2")
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]  # arms refused
    assert "training.seed (1 vs 2)" in result.stderr
    refused = record(sweep_dir(ab_repo) / "tiny" / f"{TAG}-feat")  # (feat, seed 2), the last job
    assert refused["status"] == "failed" and "training.seed (1 vs 2)" in refused["failure"]
    assert not (Path(refused["arm_dir"]) / "torchrun").exists()  # never launched


def test_ctrl_c_stops_everything(tmp_path):
    sleepy, sleepier = trainer_files(sleep_s=300), trainer_files(sleep_s=301)
    repo = make_ab_repo(tmp_path / "repo", base=sleepy, feat=sleepier)
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_perf", *SMALL_RUN, "-m", "arm=base,feat"],
        cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # as from a terminal: under a shell's background job (pytest ... &) SIGINT would be
        # inherited ignored, the Ctrl-C never seen and the sweep left running
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    log = sweep_dir(repo) / "tiny" / f"{TAG}-base" / "console.log"
    deadline = time.monotonic() + 90
    while "[moe_perf] env" not in (log.read_text() if log.exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    worktree = gitops.worktree_paths(repo)[1]  # the base arm's
    assert worktree.exists() and processes_mentioning(str(repo))

    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stdout + stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    assert processes_mentioning(str(repo)) == []
    assert not worktree.exists() and not worktree.parent.exists()
    assert_repo_untouched(repo)
    assert record(log.parent)["failure"].startswith("interrupted")
    assert not (sweep_dir(repo) / "tiny" / f"{TAG}-feat").exists()  # the sweep stopped


PLANT_AT = "def bench_hook() -> None:\n"  # train.py's plant point, called in every timed step


def test_reference_trainer_runs_each_arms_own_code(tmp_path):
    repo = copy_of_moe_perf(tmp_path / "repo")
    train = repo / "moe_perf" / "trainer" / "train.py"
    text = train.read_text()
    assert text.count(PLANT_AT) == 1, "the planted slowdown goes in train.py's bench_hook"
    git(repo, "checkout", "-q", "-b", "slower-step")
    train.write_text(text.replace(PLANT_AT, PLANT_AT + "    time.sleep(0.25)\n"))
    git(repo, "commit", "-q", "-am", "plant a 0.25 s sleep in every training step")

    # run from outside the copy: the runner is the installed one, each arm's trainer its own
    small = ["training.sequence_length=64", "training.global_batch=4", "training.max_steps=4",
             "wandb.mode=disabled", "timeout_s=240", "compare.max_pairs=1"]  # fmt: skip
    result = moe_perf(tmp_path, f"repo={repo}", *small, "-m", "arm=base,feat")
    assert_ok(result)
    assert "both arms run the same" not in result.stdout
    arms = tmp_path / "outputs" / "validate-performance" / "tiny"
    base, feat = (record(arms / f"pp1-dp1-cp1-ep1-seq64-fp32-{arm}") for arm in ("base", "feat"))
    assert base["status"] == feat["status"] == "ok"
    assert feat["summary"]["step_time_s"] > base["summary"]["step_time_s"] + 0.2
    assert base["summary"]["tflops"] is not None  # the reference trainer's optional fields
    (group,) = json.loads((arms.parent / "comparison.json").read_text())["groups"]
    assert group["difference"]["step_time_s"]["words"] == "slower"
    assert_repo_untouched(repo)


def test_a_repository_without_the_trainer_says_both_arms_run_the_same_code(tmp_path):
    repo = make_repo(tmp_path / "repo")
    small = [
        "training.sequence_length=64",
        "training.global_batch=4",
        "training.max_steps=2",
        "compare.max_pairs=1",
    ]
    result = moe_perf(repo, *small, "wandb.mode=disabled", "-m", "arm=base,feat")
    assert_ok(result)
    assert "A/A run" in result.stdout
    assert "both arms run the same (installed) trainer code" in result.stdout
    shutil.rmtree(repo / "outputs")
    assert sorted(os.listdir(repo)) == [".git", "README.md"]


def test_reference_trainer_runs_the_pp_and_cp_presets(tmp_path):
    """The runner's pp2_ep2 and cp2_ep2 presets (world 4) through the real command."""
    repo = make_repo(tmp_path / "repo")
    small = ["training.sequence_length=64", "training.global_batch=8", "training.max_steps=3",
             "wandb.mode=disabled", "timeout_s=300", "compare.max_pairs=1"]  # fmt: skip
    result = moe_perf(repo, *small, "-m", "mesh=pp2_ep2,cp2_ep2", "arm=base")
    assert_ok(result)
    arms = sweep_dir(repo) / "tiny"
    for tag in ("pp2-dp2-cp1-ep2-seq64-fp32", "pp1-dp2-cp2-ep2-seq64-fp32"):
        rec = record(arms / f"{tag}-base")
        assert rec["status"] == "ok", rec.get("failure")
        assert rec["environment"]["world_size"] == 4
        assert [s["step"] for s in rec["steps"]] == [1, 2, 3]
        assert rec["summary"]["tokens_per_s"] > 0 and rec["summary"]["tflops"] is not None
    assert_repo_untouched(repo)
