"""Refs to SHAs, the clean-tree check, worktrees and the sweep lock, on real repositories."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.command import moe_perf
from helpers.repos import commit, git, make_ab_repo, write

from moe_perf.runner import git as gitops
from moe_perf.runner.session import trainer_code_note


def test_refs_resolve_branch_before_tag_then_sha(repo):
    first = git(repo, "rev-parse", "HEAD")
    second = commit(repo, {"a.txt": "a\n"}, "second")
    git(repo, "tag", "v1", first)
    git(repo, "branch", "release", second)
    git(repo, "tag", "release", first)  # a tag named like the branch: the branch wins
    assert gitops.resolve_ref(repo, "release") == second
    assert gitops.resolve_ref(repo, "v1") == first
    assert gitops.resolve_ref(repo, first) == first
    assert gitops.resolve_ref(repo, first[:8]) == first
    assert gitops.resolve_ref(repo, "main~1") == first
    assert gitops.resolve_ref(repo, "no-such-ref") is None


def test_current_branch_and_detached_head(repo, tmp_path):
    assert gitops.current_branch(repo) == "main"
    git(repo, "checkout", "-q", "--detach")
    assert gitops.current_branch(repo) == git(repo, "rev-parse", "HEAD")
    assert gitops.current_branch(tmp_path / "nowhere") is None


def test_untracked_files_count_ignored_files_do_not(repo):
    assert gitops.dirty_files(repo) == []
    commit(repo, {".gitignore": "build/\n"}, "ignore build")
    write(repo, {"build/out.bin": "x"})
    assert gitops.dirty_files(repo) == []
    write(repo, {"src/new.py": "x"})
    assert gitops.dirty_files(repo) == ["src/new.py"]
    (repo / "src" / "new.py").unlink()
    write(repo, {"README.md": "changed\n"})
    assert gitops.dirty_files(repo) == ["README.md"]
    git(repo, "add", "README.md")
    assert gitops.dirty_files(repo) == ["README.md"]


def test_worktree_is_detached_outside_the_repo_and_removed(repo):
    sha = git(repo, "rev-parse", "HEAD")
    commit(repo, {"later.txt": "later\n"}, "later")
    with gitops.worktree(repo, sha, "base") as path:
        assert repo not in path.parents
        assert git(path, "rev-parse", "HEAD") == sha
        assert not (path / "later.txt").exists()
        assert gitops.current_branch(path) == sha  # detached
        assert len(gitops.worktree_paths(repo)) == 2
    assert not path.exists() and gitops.worktree_paths(repo) == [repo.resolve()]


def test_worktree_is_removed_when_the_arm_fails(repo):
    sha = git(repo, "rev-parse", "HEAD")
    with pytest.raises(KeyboardInterrupt), gitops.worktree(repo, sha, "feat") as path:
        raise KeyboardInterrupt
    assert not path.exists() and not path.parent.exists()
    assert gitops.worktree_paths(repo) == [repo.resolve()]


def test_path_in_commit(repo):
    sha = commit(repo, {"trainer/main.py": "x\n"}, "trainer")
    assert gitops.path_in_commit(repo, sha, "trainer")
    assert gitops.path_in_commit(repo, sha, "trainer/main.py")
    assert not gitops.path_in_commit(repo, sha, "moe_perf/trainer")


def test_a_code_path_at_neither_commit_is_said_with_what_each_arm_runs(tmp_path):
    repo = make_ab_repo(tmp_path / "repo")
    shas = {"base": git(repo, "rev-parse", "main"), "feat": git(repo, "rev-parse", "feature")}
    own = ["-m", "mytrainer"]
    assert trainer_code_note(repo, "mytrainer", shas, own) is None
    typo = trainer_code_note(repo, "mytrainr", shas, own)
    assert f"trainer.code_path=mytrainr is at neither commit (base {shas['base'][:10]}, feat " \
           f"{shas['feat'][:10]}) of {repo}: check the path" in typo  # fmt: skip
    assert "`mytrainer` is in the repository, so each arm runs its own commit's copy" in typo
    assert "installed" not in typo
    installed = trainer_code_note(repo, "moe_perf/trainer", shas, ["-m", "moe_perf.trainer"])
    assert "both arms run the same (installed) trainer code" in installed
    # a trainer added on the feature branch only
    git(repo, "checkout", "-q", "-b", "new-trainer")
    shas["feat"] = commit(repo, {"newtrainer.py": "print(1)\n"}, "a trainer of its own")
    one = trainer_code_note(repo, "newtrainr.py", shas, ["-m", "newtrainer", "--steps", "2"])
    assert "is at neither commit" in one
    assert ("feat runs `newtrainer` from its own commit; at base it is not in the repository "
            "(an installed copy, if any)") in one  # fmt: skip
    script = trainer_code_note(repo, "newtrainer.py", shas, ["newtrainer.py"])
    assert "is missing at base" in script and "feat runs `newtrainer.py` from its own" in script


HOLD_LOCK = textwrap.dedent(
    """
    import sys, time
    from moe_perf.runner.git import SweepLock
    lock = SweepLock(sys.argv[1])
    lock.acquire({"sweep_id": "held-by-test"})
    print("locked", flush=True)
    time.sleep(60)
    """
)


def hold_lock(repo: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(repo)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "locked"
    return proc


@pytest.mark.slow
def test_lock_second_sweep_fails_fast_and_lock_dies_with_its_process(repo):
    holder = hold_lock(repo)
    try:
        with pytest.raises(gitops.LockBusy) as err:
            gitops.SweepLock(repo).acquire({"sweep_id": "second"})
        assert "another moe_perf sweep is running" in str(err.value)
        assert "held-by-test" in str(err.value) and str(holder.pid) in str(err.value)
    finally:
        holder.kill()
        holder.wait()
    lock = gitops.SweepLock(repo)
    lock.acquire({"sweep_id": "after"})  # a killed holder leaves no stale lock
    lock.release()


@pytest.mark.slow
def test_the_command_refuses_to_overlap_a_running_sweep(repo):
    holder = hold_lock(repo)
    try:
        result = moe_perf(repo, "wandb.mode=disabled", timeout=60)
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 2
    assert "another moe_perf sweep is running" in result.stderr
    assert not list(repo.rglob("console.log"))


def test_lock_lives_in_the_common_git_dir_shared_by_worktrees(repo):
    sha = git(repo, "rev-parse", "HEAD")
    with gitops.worktree(repo, sha, "x") as path:
        assert gitops.SweepLock(path).path == gitops.SweepLock(repo).path
        assert gitops.SweepLock(repo).path.parent == (repo / ".git").resolve()
