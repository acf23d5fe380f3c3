"""`dry_run=true` through the real command: each arm's launch printed, nothing launched or kept."""

from __future__ import annotations

import sys

from conftest import SMALL_RUN, git, moe_perf, sweep_dir


def test_dry_run_prints_both_arms_and_launches_nothing(ab_repo):
    shas = {"base": git(ab_repo, "rev-parse", "main"), "feat": git(ab_repo, "rev-parse", "feature")}
    result = moe_perf(ab_repo, *SMALL_RUN, "dry_run=true", "-m", "arm=base,feat")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    for arm in ("base", "feat"):
        command = next(line for line in out.splitlines() if f"{arm}: command " in line)
        # one process: the trainer alone, with torchrun's environment for rank 0 of 1
        assert command.split(" command ", 1)[1].startswith(f"{sys.executable} -m mytrainer ")
        env = next(line for line in out.splitlines() if f"{arm}: env " in line)
        assert "RANK=0" in env and "WORLD_SIZE=1" in env and "MASTER_PORT=" in env
        cwd = next(line for line in out.splitlines() if f"{arm}: cwd " in line)
        assert shas[arm][:10] in cwd  # each arm's command is built from its own commit
        assert f"{arm}: dry run, nothing launched" in out
    assert "nothing to compare" in out
    # no arm directory, no record, no worktree left
    assert not list(sweep_dir(ab_repo).glob("*/*/metrics.json"))
    assert not (sweep_dir(ab_repo) / "tiny").exists()
    assert len(git(ab_repo, "worktree", "list").splitlines()) == 1
    assert git(ab_repo, "status", "--porcelain") == ""


def test_dry_run_still_refuses_what_a_real_run_refuses(ab_repo):
    result = moe_perf(ab_repo, *SMALL_RUN, "dry_run=true", "training.sequence_length=63",
                      "-m", "arm=base,feat")  # fmt: skip
    assert result.returncode == 2
    assert "training.sequence_length" in result.stderr
    assert "command " not in result.stdout
