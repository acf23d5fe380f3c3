"""`python -m moe_perf bisect GOOD BAD [overrides]`: the first commit that made the step slower.

Each probe is a whole sweep of the real command, `refs.base=GOOD refs.feat=<probe> -m
arm=base,feat`, with pairs added until its verdict is decided (moe_perf/stats/verdict.py),
each in a sweep directory of its own that is kept. The probes walk the first-parent commits
between GOOD and BAD, as `git bisect --first-parent` does:

1. BAD itself first: it must be DIFFERENT from GOOD; the sign of that difference is the
   regression's direction (slower or faster). Unless `compare.effect` is given, the probes
   that follow use half the regression as their effect (at most 50%): a commit is SAME when
   it is within half of the regression of GOOD.
2. Then halving: a probe DIFFERENT in the regression's direction is bad, a SAME one good, and
   so is a DIFFERENT one whose whole interval lies within the effect (a machine's offset the
   verdict resolves, not the regression).
   A probe whose arms fail (a broken build, a crash) is skipped, like `git bisect skip`; the
   next probe is the untested commit nearest the middle. An UNKNOWN probe (or a DIFFERENT one
   in the other direction) ends the bisection with the range narrowed so far, not a guess.

With n commits between GOOD and BAD it takes about 1 + log2(n) probes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from moe_perf.common.errors import REFUSED, PrerequisiteError
from moe_perf.report.results.comparison import Comparison, ComparisonError
from moe_perf.runner import git, outputs, preflight
from moe_perf.runner.job import say

DIFFERENT, SAME = "DIFFERENT", "SAME"
MAX_EFFECT = 0.5  # a probe's effect at most: half of a regression that doubled the step
BISECT_DIR = Path("outputs/bisect")
USAGE = "python -m moe_perf bisect GOOD BAD [overrides, e.g. model=... mesh=...]"


@dataclass
class Probe:
    """One commit measured against GOOD."""

    sha: str
    subject: str
    sweep_dir: str
    word: str | None = None  # SAME | DIFFERENT | UNKNOWN; None when the probe failed
    estimate: float | None = None
    low: float | None = None
    high: float | None = None
    effect: float | None = None  # the verdict's compare.effect
    pairs: int = 0
    failed: str | None = None  # why the probe could not measure (a failed arm, no verdict)

    def within_effect(self) -> bool:
        """Whether the whole interval lies within +/- the effect (a DIFFERENT verdict too:
        the interval excludes zero, yet no change as large as the effect)."""
        bounds = (self.low, self.high, self.effect)
        return None not in bounds and max(abs(self.low), abs(self.high)) < self.effect

    def line(self) -> str:
        head = f"{self.sha[:10]} {self.subject[:50]}"
        if self.failed:
            return f"{head}: skipped ({self.failed})"
        interval = (f" ({self.low:+.2%} to {self.high:+.2%})"
                    if self.low is not None and self.high is not None else "")  # fmt: skip
        return f"{head}: {self.estimate:+.2%}{interval}, {self.pairs} pair(s): {self.word}"


@dataclass
class Bisection:
    repo: Path
    good: str
    bad: str
    commits: list[str]  # first-parent commits after GOOD up to BAD, oldest first
    out_dir: Path
    overrides: list[str]
    probes: list[Probe] = field(default_factory=list)
    direction: int = 0  # +1: the regression made the step slower; -1: faster
    effect: float | None = None  # the probes' compare.effect after the first probe

    # -- one probe ----------------------------------------------------------------------------

    def probe(self, sha: str) -> Probe:
        index = len(self.probes) + 1
        sweep_dir = self.out_dir / f"probe{index:02d}-{sha[:10]}"
        found = Probe(sha, subject(self.repo, sha), str(sweep_dir))
        extra = [f"compare.effect={self.effect:g}"] if self.effect is not None else []
        command = [sys.executable, "-m", "moe_perf", f"refs.base={self.good}",
                   f"refs.feat={sha}", f"hydra.sweep.dir={sweep_dir}", *self.overrides,
                   *extra, "-m", "arm=base,feat"]  # fmt: skip
        say(f"probe {index}: {sha[:10]} {found.subject[:60]} -> {sweep_dir}")
        with open(self.out_dir / f"probe{index:02d}.log", "w") as log:
            proc = subprocess.run(command, cwd=self.repo, stdout=log, stderr=subprocess.STDOUT,
                                  check=False)  # fmt: skip
        if proc.returncode == REFUSED:  # the sweep's own pre-flight: no commit's fault
            said = (self.out_dir / f"probe{index:02d}.log").read_text().strip().splitlines()
            raise BisectError(f"probe {index} was refused before it ran: "
                              f"{' / '.join(said[-3:])}")  # fmt: skip
        read_verdict(found, sweep_dir, proc.returncode)
        self.probes.append(found)
        say(f"probe {index}: {found.line()}")
        return found

    def is_bad(self, probe: Probe) -> bool | None:
        """True: carries the regression; False: does not; None: cannot tell (ends the search)."""
        if probe.word == SAME or probe.within_effect():
            return False
        if probe.word == DIFFERENT and probe.estimate is not None:
            return (probe.estimate > 0) == (self.direction > 0) or None
        return None

    # -- the search ---------------------------------------------------------------------------

    def run(self) -> tuple[int, int, set[int]]:
        """(last good index, first bad index, skipped indices) into `commits`; -1 is GOOD."""
        first = self.probe(self.commits[-1])
        if first.word != DIFFERENT or first.estimate is None:
            raise BisectError(f"{self.bad} is not DIFFERENT from {self.good}: "
                              f"{first.line()}; nothing to bisect")  # fmt: skip
        self.direction = 1 if first.estimate > 0 else -1
        if not any(o.startswith("compare.effect=") for o in self.overrides):
            self.effect = min(abs(first.estimate) / 2, MAX_EFFECT)
            say(f"the probes' effect: half the regression, compare.effect={self.effect:.4g}")
        low, high, skipped = -1, len(self.commits) - 1, set()
        while True:
            index = next_probe(low, high, skipped)
            if index is None:
                return low, high, skipped
            probe = self.probe(self.commits[index])
            if probe.failed:
                skipped.add(index)
                continue
            verdict = self.is_bad(probe)
            if verdict is None:
                return low, high, skipped
            low, high = (low, index) if verdict else (index, high)


class BisectError(RuntimeError):
    """The bisection cannot start or go on: the message says why."""


def next_probe(low: int, high: int, skipped: set[int]) -> int | None:
    """The untested index strictly between `low` and `high` nearest their middle."""
    middle = (low + high) / 2
    open_ = [i for i in range(low + 1, high) if i not in skipped]
    return min(open_, key=lambda i: (abs(i - middle), i)) if open_ else None


def read_verdict(probe: Probe, sweep_dir: Path, exit_code: int) -> None:
    """Fills `probe` from its sweep's comparison.json (the step-time verdict)."""
    try:
        report = Comparison.load(sweep_dir / "comparison.json")
    except ComparisonError:
        probe.failed = f"the sweep wrote no comparison (exit code {exit_code})"
        return
    failed = report.failed_runs
    if failed:
        probe.failed = f"{failed[0].arm} failed: {failed[0].failure}"
        return
    groups = report.groups
    found = (groups[0].verdict or {}).get("step_time_s") if len(groups) == 1 else None
    if not found:
        probe.failed = f"no step-time verdict in {sweep_dir / 'comparison.json'}"
        return
    probe.word, probe.pairs = found.word, int(found.pairs)
    probe.estimate, probe.low, probe.high = found.estimate, found.low, found.high
    probe.effect = found.effect


def subject(repo: Path, sha: str) -> str:
    return git.git(repo, "log", "-1", "--format=%s", sha)


def first_parent_commits(repo: Path, good: str, bad: str) -> list[str]:
    """The first-parent commits after `good` up to `bad`, oldest first."""
    listed = git.git(repo, "rev-list", "--first-parent", "--reverse", f"{good}..{bad}")
    try:
        git.git(repo, "merge-base", "--is-ancestor", good, bad)
    except git.GitError:
        raise BisectError(f"{good[:10]} is not an ancestor of {bad[:10]}: give GOOD first, "
                          f"then a BAD that descends from it") from None  # fmt: skip
    commits = listed.split()
    if not commits:
        raise BisectError(f"no commits after {good[:10]} up to {bad[:10]}: nothing to bisect")
    return commits


def summary(bisection: Bisection, low: int, high: int, skipped: set[int]) -> list[str]:
    """The chain of probes and the answer, as printed and written to bisect.md."""
    commits = bisection.commits
    lines = [f"bisect {bisection.good[:10]}..{bisection.bad[:10]}: {len(commits)} commit(s), "
             f"{len(bisection.probes)} probe(s)", ""]  # fmt: skip
    lines += [f"{i}. {p.line()}" for i, p in enumerate(bisection.probes, 1)]
    lines.append("")
    candidates = [commits[i] for i in range(low + 1, high + 1)]
    way = "slower" if bisection.direction > 0 else "faster"
    if len(candidates) == 1:
        lines.append(f"first commit DIFFERENT ({way}): {high_line(bisection, commits[high])}")
    else:
        why = ("only skipped commits are left" if all(i in skipped for i in range(low + 1, high))
               else "a probe did not decide")  # fmt: skip
        lower = commits[low][:10] if low >= 0 else bisection.good[:10]
        lines.append(f"not narrowed to one commit ({why}): the change that made the step {way} "
                     f"is one of the {len(candidates)} commits after {lower} up to "
                     f"{commits[high][:10]}:")  # fmt: skip
        lines += [f"  {sha[:10]} {subject(bisection.repo, sha)[:60]}" for sha in candidates]
    return lines


def high_line(bisection: Bisection, sha: str) -> str:
    return f"{sha} {subject(bisection.repo, sha)}"


def parse_args(argv: list[str]) -> tuple[str, str, list[str]]:
    refs = [a for a in argv if "=" not in a and not a.startswith("-")]
    overrides = [a for a in argv if "=" in a]
    flags = [a for a in argv if a.startswith("-") and "=" not in a]
    if len(refs) != 2 or flags:
        raise BisectError(f"usage: {USAGE}" + (f" (no flags: {' '.join(flags)})" if flags else ""))
    for override in overrides:
        if override.split("=")[0].lstrip("+~") in ("refs.base", "refs.feat", "hydra.sweep.dir",
                                                    "arm", "repeat"):  # fmt: skip
            raise BisectError(f"{override}: bisect sets it for each probe; remove it")
    return refs[0], refs[1], overrides


def main(argv: list[str]) -> int:
    """Exit code 0 when one commit is named, 1 when the range could not be narrowed to one,
    2 when the bisection cannot start."""
    try:
        good_ref, bad_ref, overrides = parse_args(argv)
        repo = preflight.find_repo(".", Path.cwd())
        preflight.check_clean_tree(repo)
        shas = preflight.resolve_refs(repo, {"base": good_ref, "feat": bad_ref})
        good, bad = shas["base"], shas["feat"]
        commits = first_parent_commits(repo, good, bad)
    except (BisectError, PrerequisiteError, git.GitError) as err:
        say(f"cannot bisect: {err}", sys.stderr)
        return 2
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = repo / BISECT_DIR / f"{good[:10]}..{bad[:10]}-{stamp}"
    outputs.ignore_outputs(repo, repo / BISECT_DIR)  # the probes' own sweeps need a clean tree
    out_dir.mkdir(parents=True)
    say(f"bisect {good_ref} @ {good[:10]} (good) .. {bad_ref} @ {bad[:10]} (bad): "
        f"{len(commits)} first-parent commit(s); probes in {out_dir}")  # fmt: skip
    bisection = Bisection(repo, good, bad, commits, out_dir, overrides)
    try:
        low, high, skipped = bisection.run()
    except BisectError as err:
        say(str(err), sys.stderr)
        write(bisection, [str(err)])
        return 1
    lines = summary(bisection, low, high, skipped)
    print("\n".join(lines), flush=True)
    write(bisection, lines)
    return 0 if high - low == 1 else 1


def write(bisection: Bisection, lines: list[str]) -> None:
    (bisection.out_dir / "bisect.md").write_text("\n".join(lines) + "\n")
    data = {
        "schema": "moe_perf.bisect/1",
        **{k: getattr(bisection, k) for k in ("good", "bad", "commits", "direction", "effect")},
        "probes": [asdict(p) for p in bisection.probes],
    }
    (bisection.out_dir / "bisect.json").write_text(json.dumps(data, indent=2) + "\n")
