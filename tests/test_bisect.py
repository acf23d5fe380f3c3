"""Bisect: the real `python -m moe_perf bisect GOOD BAD` over a repository of 8 commits whose
5th makes every step slower, each probe a real sweep with pairs until decided."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.command import moe_perf
from helpers.repos import commit, git, make_repo

from moe_perf.runner.bisect import BisectError, Bisection, Probe, next_probe, parse_args

WORK_TRAINER = Path(__file__).parent / "helpers" / "work_trainer.py"
# the step's CPU time: the measured work, unmoved by other processes on a shared test machine
RUN = ["trainer.command=[-m,mytrainer]", "trainer.code_path=mytrainer",
       "training.sequence_length=64", "training.global_batch=4", "training.max_steps=8",
       "wandb.mode=disabled", "timeout_s=120",
       # each probe decides at its one look, the fourth pair: a clear 2x or within half of it
       "compare.max_pairs=4"]  # fmt: skip


def history(path: Path, broken: int | None = None) -> list[str]:
    """Commits 1..8 (1 is GOOD, 8 is BAD); from commit 5 on every step does twice the work;
    commit `broken` crashes after its second step."""
    knobs = {"iterations": 20}
    files = {"mytrainer/__main__.py": WORK_TRAINER.read_text(), ".gitignore": "__pycache__/\n"}
    make_repo(path, {**files, "mytrainer/knobs.json": json.dumps(knobs)})
    shas = [git(path, "rev-parse", "HEAD")]
    for i in range(2, 9):
        knobs = {"iterations": 40 if i >= 5 else 20,
                 "exit_after_step": 2 if i == broken else None}  # fmt: skip
        shas.append(commit(path, {"mytrainer/knobs.json": json.dumps(knobs),
                                  f"notes/{i}.txt": "x"}, f"commit {i}"))  # fmt: skip
    return shas


def bisect_json(repo: Path) -> dict:
    (found,) = (repo / "outputs" / "bisect").glob("*/bisect.json")
    return json.loads(found.read_text())


@pytest.mark.slow
def test_bisect_names_the_commit_that_made_the_step_slower(tmp_path):
    repo = tmp_path / "repo"
    shas = history(repo)
    result = moe_perf(repo, "bisect", shas[0], shas[-1], *RUN, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"first commit DIFFERENT (slower): {shas[4]} commit 5" in result.stdout
    found = bisect_json(repo)
    assert len(found["probes"]) <= 4 and found["direction"] == 1
    assert found["probes"][0]["sha"] == shas[-1]  # BAD is confirmed first
    for probe in found["probes"]:  # every probe's sweep and its arms are kept
        assert probe["word"] in ("SAME", "DIFFERENT")
        assert len(list(Path(probe["sweep_dir"]).rglob("metrics.json"))) >= 2 * probe["pairs"]
        assert probe["sha"][:10] in result.stdout
    assert git(repo, "status", "--porcelain") == ""  # the tree stays clean


@pytest.mark.slow
def test_bisect_skips_a_commit_that_fails_to_run(tmp_path):
    repo = tmp_path / "repo"
    shas = history(repo, broken=6)
    # GOOD is commit 4: the failing commit 6 is the middle of 5..8, the first probe after BAD's
    result = moe_perf(repo, "bisect", shas[3], shas[-1], *RUN, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"first commit DIFFERENT (slower): {shas[4]} commit 5" in result.stdout
    skipped = [p for p in bisect_json(repo)["probes"] if p["failed"]]
    assert [p["sha"] for p in skipped] == [shas[5]]
    assert "exited with code 1" in skipped[0]["failed"]
    assert "skipped" in result.stdout


@pytest.mark.slow
def test_bisect_refuses_what_it_cannot_bisect(tmp_path):
    repo = tmp_path / "repo"
    shas = history(repo)
    backwards = moe_perf(repo, "bisect", shas[-1], shas[0], *RUN)
    assert backwards.returncode == 2 and "is not an ancestor of" in backwards.stderr
    (repo / "untracked.txt").write_text("dirty")
    dirty = moe_perf(repo, "bisect", shas[0], shas[-1], *RUN)
    assert dirty.returncode == 2 and "untracked.txt" in dirty.stderr
    assert not (repo / "outputs" / "bisect").exists()


def test_the_next_probe_is_the_untested_commit_nearest_the_middle():
    assert next_probe(-1, 6, set()) == 2  # commits 0..6 untested between GOOD and BAD
    assert next_probe(-1, 6, {2}) == 3
    assert next_probe(2, 4, set()) == 3
    assert next_probe(2, 4, {3}) is None  # only skipped commits left
    assert next_probe(3, 4, set()) is None


def test_a_probe_within_the_effect_is_good_whatever_its_word(tmp_path):
    """A probe 5.6% faster than GOOD (interval -6.9% to -4.3%) against a +106% regression
    (effect 50%) was DIFFERENT and ended a bisection once: it does not carry the regression."""
    bisection = Bisection(tmp_path, "good", "bad", [], tmp_path, [], direction=1, effect=0.5)

    def probe(word, estimate, low, high):
        return Probe("sha", "subject", "dir", word, estimate, low, high, effect=0.5)

    assert bisection.is_bad(probe("DIFFERENT", -0.056, -0.069, -0.043)) is False
    assert bisection.is_bad(probe("DIFFERENT", 0.04, 0.01, 0.07)) is False
    assert bisection.is_bad(probe("DIFFERENT", 1.0, 0.7, 1.4)) is True
    assert bisection.is_bad(probe("DIFFERENT", -0.7, -0.9, -0.6)) is None  # the other way
    assert bisection.is_bad(probe("DIFFERENT", 0.4, 0.1, 0.7)) is True  # across the effect
    assert bisection.is_bad(probe("UNKNOWN", 0.1, -0.2, 0.7)) is None
    assert bisection.is_bad(probe("SAME", 0.0, -0.1, 0.1)) is False


def test_bisect_arguments():
    assert parse_args(["main", "feature", "model=tiny"]) == ("main", "feature", ["model=tiny"])
    with pytest.raises(BisectError, match="usage"):
        parse_args(["main"])
    with pytest.raises(BisectError, match="refs.base=x: bisect sets it"):
        parse_args(["main", "feature", "refs.base=x"])
