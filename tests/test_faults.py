"""Faults and bad data never become numbers: the real `python -m moe_perf` in temporary git
repositories whose stand-in trainer (trainer=command, no torch) misbehaves on purpose: prints
NaN or impossible step lines, exits with its own code, runs out of memory, ignores SIGTERM.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers.command import moe_perf, sweep_dir
from helpers.repos import commit, git, make_repo

from moe_perf.runner.session import end_sweep

pytestmark = pytest.mark.slow

# MODE picks the fault; the feature branch of a test repository commits another MODE.
STAND_IN = textwrap.dedent(
    '''
    """A stand-in trainer that misbehaves as MODE says."""
    import os
    import signal
    import sys
    import time

    MODE = "ok"
    steps = int(sys.argv[1])
    rank = int(os.environ.get("RANK", "0"))

    def line(step, of, t, tps):
        return f"[moe_perf] step={step}/{of} step_time_s={t} tokens_per_s={tps} peak_mem_gib=1.0"

    if MODE == "ignore_term":  # tells the test its pid, once it ignores SIGTERM
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with open(os.path.join(os.environ["TEST_PID_DIR"], f"pid-{rank}"), "w") as f:
            f.write(str(os.getpid()))
    for step in range(1, steps + 1):
        time.sleep(0.02)
        if rank != 0:
            continue
        if MODE == "nan":
            print(line(step, steps, "nan", 12800), flush=True)
        elif MODE == "beyond":
            print(line(100 + step, steps, -1, "inf"), flush=True)
        else:
            print(line(step, steps, 0.02, 12800), flush=True)
        if MODE == "exit3" and step == 2:
            os._exit(3)
        if MODE == "oom" and step == 2:
            print("Traceback (most recent call last):", file=sys.stderr)
            print('  File "train.py", line 9, in step', file=sys.stderr)
            print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 "
                  "has a total capacity of 139.80 GiB of which 1.25 GiB is free.",
                  file=sys.stderr, flush=True)
            sys.exit(1)
        if MODE == "nccl" and step == 2:
            print("[rank0]:[E1203 17:40:01.123 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog "
                  "caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, "
                  "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600042 milliseconds "
                  "before timing out.", file=sys.stderr, flush=True)
            os.abort()
        if MODE == "sigkill" and step == 2:  # as the kernel's OOM killer does
            os.kill(os.getpid(), signal.SIGKILL)
        if MODE == "raise" and step == 2:
            raise ValueError("expert weights of layer 3 have shape (8, 64), want (8, 96)")
        if MODE == "ignore_term" and step == 2:
            while True:
                time.sleep(0.1)
    '''
)


def stand_in_repo(path: Path, base: str = "ok", feat: str = "ok") -> Path:
    """`main` runs the stand-in in mode `base`; `feature` (checked out) in mode `feat`."""
    make_repo(path, {"faulty/train.py": STAND_IN.replace('MODE = "ok"', f'MODE = "{base}"'),
                     ".gitignore": "__pycache__/\n"})  # fmt: skip
    git(path, "checkout", "-q", "-b", "feature")
    feat_text = STAND_IN.replace('MODE = "ok"', f'MODE = "{feat}"') + "# the feature branch\n"
    commit(path, {"faulty/train.py": feat_text}, "feat")
    return path


RUN = [
    "trainer=command",
    "trainer.command=[faulty/train.py,'{training.max_steps}']",
    "training.sequence_length=64",
    "training.global_batch=4",
    "training.max_steps=5",
    "wandb.mode=disabled",
    "compare.max_pairs=1",
    "timeout_s=60",
]


def strict(path: Path) -> dict:
    """The file parsed as strict JSON: NaN or Infinity fail the test."""

    def refuse(constant: str):
        raise AssertionError(f"{path} holds {constant}: not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def arm_dir(repo: Path, arm: str) -> Path:
    """The arm's directory of the tiny model (its tag follows the shipped dtype default)."""
    (found,) = (sweep_dir(repo) / "tiny").glob(f"pp1-dp1-cp1-ep1-seq64-*-{arm}")
    return found


def arm_record(repo: Path, arm: str) -> dict:
    return strict(arm_dir(repo, arm) / "metrics.json")


@pytest.fixture(scope="module")
def ok_sweep_repo(tmp_path_factory) -> Path:
    """A stand-in repository right after one real `-m arm=base,feat` sweep whose arms both
    passed, run once for the tests below that start from such a sweep."""
    repo = stand_in_repo(tmp_path_factory.mktemp("ok-sweep") / "repo")
    first = moe_perf(repo, *RUN, "-m", "arm=base,feat")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    return repo


@pytest.fixture
def swept_repo(ok_sweep_repo: Path, tmp_path: Path) -> Path:
    """This test's own copy of `ok_sweep_repo` (git history, sweep directory and all), so what
    one test does to it never reaches another."""
    return Path(shutil.copytree(ok_sweep_repo, tmp_path / "repo", symlinks=True))


# ---- bad step lines --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("nan", "step 1: step_time_s=nan is not a positive number"),
        ("beyond", "step 101 is beyond its own /5"),
    ],
)
def test_bad_step_lines_fail_the_arm_and_every_json_is_strict(tmp_path, mode, reason):
    repo = stand_in_repo(tmp_path / "repo", feat=mode)
    result = moe_perf(repo, *RUN, "-m", "arm=base,feat")
    out = result.stdout + result.stderr
    assert result.returncode == 3, out[-3000:]  # the sweep ran, an arm failed
    base, feat = arm_record(repo, "base"), arm_record(repo, "feat")
    assert base["status"] == "ok"
    assert feat["status"] == "failed" and reason in feat["failure"], feat["failure"]
    assert reason in out  # on the console too
    report = strict(sweep_dir(repo) / "comparison.json")
    (group,) = report["groups"]
    assert group["status"] == "incomplete" and group["difference"] == {}
    assert "faster" not in out and "same speed" not in out
    strict(sweep_dir(repo) / ".moe_perf" / "sweep.json")


def test_each_bad_step_line_is_named():
    from moe_perf.common.contract import format_step
    from moe_perf.logs import parse_lines

    def line(step, t=0.5, of=4, tps=100.0):
        return "[rank0]:" + format_step(step, of, step_time_s=t, tokens_per_s=tps, peak_mem_gib=1)

    cases = {
        "step 2 printed after step 3 (out of order)": [line(1), line(3), line(2), line(4)],
        "step 2 printed twice with different values": [line(1), line(2), line(2, t=0.4)],
        "step 2: step_time_s=0 is not a positive number": [line(1), line(2, t=0), line(3)],
        "step 3: tokens_per_s=-1 is not a positive number": [line(1), line(2), line(3, tps=-1)],
        "step 5 is beyond its own /4": [line(k) for k in range(1, 6)],
    }
    for reason, lines in cases.items():
        failure = parse_lines(lines, "contract").failure(4)
        assert failure and reason in failure, (reason, failure)
    beyond = parse_lines([line(k, of=9) for k in range(1, 6)], "contract").failure(4)
    assert "step 5 is beyond training.max_steps=4" in beyond
    same = parse_lines([line(1), line(2), line(2), line(3), line(4)], "contract")
    assert same.failure(4) is None and "the repeat dropped: step(s) 2" in same.derivations[0]


# ---- exit status and failure reasons ---------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "code", "reason"),
    [
        ("exit3", 3, "trainer exited with code 3 (rank 0)"),
        ("oom", 1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB."),
        ("nccl", -6, "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7"),
        ("raise", 1, "ValueError: expert weights of layer 3 have shape (8, 64), want (8, 96)"),
        ("sigkill", -9, "trainer killed by SIGKILL (rank 0): the kernel's out-of-memory killer"),
    ],
)
def test_a_failed_arm_has_its_code_and_reason_and_the_sweep_exits_3(tmp_path, mode, code, reason):
    repo = stand_in_repo(tmp_path / "repo", feat=mode)
    result = moe_perf(repo, *RUN, "-m", "arm=base,feat")
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    feat = arm_record(repo, "feat")
    assert feat["status"] == "failed"
    # one process, launched without torchrun: the launch's status is the trainer's own
    assert feat["exit_code"] == code and feat["launch_exit_code"] == code
    assert reason in feat["failure"], feat["failure"]
    assert reason in result.stderr  # the console
    (run,) = [r for r in strict(sweep_dir(repo) / "comparison.json")["groups"][0]["runs"]
              if r["arm"] == "feat"]  # fmt: skip
    assert reason in run["failure"]
    assert reason in (sweep_dir(repo) / "comparison.md").read_text()


# ---- orphans and interrupts ------------------------------------------------------------------


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_runner(repo: Path, pid_dir: Path, *args: str) -> tuple[subprocess.Popen, int]:
    """`python -m moe_perf ARGS` in the background, once its trainer (mode ignore_term) runs:
    (the runner, the trainer's pid)."""
    runner = subprocess.Popen(
        [sys.executable, "-m", "moe_perf", *RUN, *args],
        cwd=repo,
        env={**os.environ, "TEST_PID_DIR": str(pid_dir)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # as from a terminal: a shell's background job would inherit SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    while not (pid_dir / "pid-0").exists():
        assert runner.poll() is None and time.monotonic() < deadline, runner.communicate()
        time.sleep(0.1)
    time.sleep(0.3)  # past the pid file: in the loop that ignores SIGTERM
    return runner, int((pid_dir / "pid-0").read_text())


def test_a_killed_runners_launch_is_stopped_by_the_next_sweep(tmp_path):
    repo = stand_in_repo(tmp_path / "repo", base="ignore_term", feat="ok")
    runner, trainer = start_runner(repo, tmp_path, "arm=base")
    runner.kill()  # SIGKILL: the OOM killer, a closed terminal
    runner.communicate()
    try:
        time.sleep(1)
        assert alive(trainer)  # orphaned: re-parented, still holding the devices
        assert len(git(repo, "worktree", "list").splitlines()) == 2
        # the orphan ignores SIGTERM: it goes at SIGKILL, after the grace (10 s by default)
        result = moe_perf(repo, *RUN, "arm=feat", "launcher.kill_grace_s=1")
        out = result.stdout + result.stderr
        assert result.returncode == 0, out[-3000:]
        assert "stopped 1 launch(es) of an earlier moe_perf sweep whose runner died" in out
        assert f"{trainer} (" in out  # named by pid
        assert "removed 1 worktree(s) left by an earlier moe_perf sweep" in out
        assert not alive(trainer)
        assert len(git(repo, "worktree", "list").splitlines()) == 1
        assert arm_record(repo, "feat")["status"] == "ok"
    finally:
        if alive(trainer):
            os.kill(trainer, signal.SIGKILL)


FREEZER = Path("/sys/fs/cgroup/freezer")  # cgroup v1 freezer, as `docker pause` uses


def can_freeze() -> bool:
    return FREEZER.is_dir() and os.access(FREEZER, os.W_OK)


@pytest.mark.skipif(not can_freeze(), reason="needs a writable cgroup v1 freezer (root)")
def test_an_orphan_that_cannot_be_stopped_is_named_and_the_sweep_refused(tmp_path):
    # A frozen task takes no signal until it is thawed: SIGKILL stays pending, the process
    # stays (state D), as a launch paused by a container or scheduler would.
    repo = stand_in_repo(tmp_path / "repo", base="ignore_term", feat="ok")
    runner, trainer = start_runner(repo, tmp_path, "arm=base")
    runner.kill()
    runner.communicate()
    cgroup = FREEZER / f"moe_perf_test_{os.getpid()}"
    cgroup.mkdir()
    try:
        (cgroup / "cgroup.procs").write_text(str(trainer))
        (cgroup / "freezer.state").write_text("FROZEN")
        before = sorted(sweep_dir(repo).rglob("*"))  # the dead sweep's files
        result = moe_perf(repo, *RUN, "arm=feat", "launcher.kill_grace_s=1")
        assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
        (line,) = [x for x in result.stderr.splitlines() if "died and its launch" in x]
        assert f"pid(s) {trainer} (" in line  # the one left, by pid and command
        assert f"{trainer}: user {pwd.getpwuid(os.getuid()).pw_name}, state D" in line  # frozen
        assert f"`kill -9 {trainer}`" in line and "start the sweep again" in line
        assert "Traceback" not in result.stderr
        assert alive(trainer)
        assert sorted(sweep_dir(repo).rglob("*")) == before  # refused before writing
    finally:
        (cgroup / "freezer.state").write_text("THAWED")
        if alive(trainer):
            os.kill(trainer, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while alive(trainer) and time.monotonic() < deadline:
            time.sleep(0.05)
        cgroup.rmdir()
        end_sweep(sweep_dir(repo))  # the dead sweep's worktree, outside tmp_path


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_says_what_it_does_and_returns_when_the_arm_is_gone(tmp_path, presses):
    repo = stand_in_repo(tmp_path / "repo", base="ignore_term")
    runner, trainer = start_runner(repo, tmp_path, "arm=base", "launcher.kill_grace_s=4")
    try:
        runner.send_signal(signal.SIGINT)
        started = time.monotonic()
        if presses == 2:
            time.sleep(1.0)
            runner.send_signal(signal.SIGINT)
        out, err = runner.communicate(timeout=60)
        took = time.monotonic() - started
        console = out + err
        assert runner.returncode == 130, console[-3000:]
        assert not alive(trainer)  # the runner exits only once the arm's processes are gone
        assert "interrupted: stopping the arm (SIGTERM to its processes); waiting up to 4 s" in (
            console
        )
        if presses == 2:
            assert "interrupted again: SIGKILL sent" in console and took < 4
        else:
            assert "still up after 4 s: SIGKILL sent" in console and took >= 4
        # the trainer's words about the signal stay in console.log, with its steps
        assert "Traceback" not in console
        assert "[moe_perf] step=1/" in (arm_dir(repo, "base") / "console.log").read_text()
        assert len(git(repo, "worktree", "list").splitlines()) == 1
        assert arm_record(repo, "base")["failure"] == "interrupted (Ctrl-C/SIGTERM)"
    finally:
        runner.kill()
        if alive(trainer):
            os.kill(trainer, signal.SIGKILL)


# ---- outputs ---------------------------------------------------------------------------------


def test_a_users_file_under_outputs_is_never_hidden(tmp_path):
    repo = stand_in_repo(tmp_path / "repo")
    (repo / "outputs").mkdir()
    (repo / "outputs" / "my-notes.txt").write_text("mine\n")  # untracked, no outputs/.gitignore
    result = moe_perf(repo, *RUN, "-m", "arm=base,feat")
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert "is not clean (outputs/my-notes.txt)" in result.stderr
    assert "?? outputs/my-notes.txt" in git(repo, "status", "--porcelain", "-uall")  # not hidden
    assert sorted(p.name for p in (repo / "outputs").iterdir()) == ["my-notes.txt"]


def test_a_sweep_directory_holding_a_users_files_is_refused(tmp_path):
    repo = stand_in_repo(tmp_path / "repo")
    commit(repo, {"outputs/validate-performance/README.md": "our results\n"}, "results")
    git(repo, "checkout", "-q", "feature")
    git(repo, "merge", "-q", "main")
    result = moe_perf(repo, *RUN, "refs.base=feature", "-m", "arm=base,feat")
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert "holds files moe_perf did not write" in result.stderr
    assert "validate-performance/README.md" in result.stderr
    assert sorted(p.name for p in sweep_dir(repo).iterdir()) == ["README.md"]
    assert git(repo, "status", "--porcelain") == ""


def test_a_refused_sweep_writes_nothing(tmp_path):
    from moe_perf.runner.git import SweepLock

    repo = stand_in_repo(tmp_path / "repo")
    bad = moe_perf(repo, *RUN, "training.max_steps=1", "-m", "arm=base,feat")
    assert bad.returncode == 2 and "training.max_steps" in bad.stderr, bad.stderr[-3000:]
    assert not (repo / "outputs").exists()
    lock = SweepLock(repo)  # another sweep holds the repository
    lock.acquire({"sweep_id": "held-by-the-test"})
    try:
        busy = moe_perf(repo, *RUN, "-m", "arm=base,feat")
    finally:
        lock.release()
    assert busy.returncode == 2, busy.stdout[-3000:] + busy.stderr[-3000:]
    assert "another moe_perf sweep is running" in busy.stderr and "held-by-the-test" in busy.stderr
    assert not (repo / "outputs").exists()  # no multirun.yaml, no .gitignore, nothing
    assert git(repo, "status", "--porcelain") == ""


def test_an_earlier_sweep_is_kept_whole_and_its_comparison_rebuilt(swept_repo):
    repo = swept_repo
    first_id = strict(sweep_dir(repo) / ".moe_perf" / "sweep.json")["sweep_id"]
    second = moe_perf(repo, *RUN, "arm=base")  # a later sweep into the same directory
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"kept earlier sweep {first_id} in" in second.stdout
    kept = sweep_dir(repo) / "previous" / first_id
    for name in ("multirun.yaml", ".moe_perf/sweep.json", "comparison.json", "comparison.md"):
        assert (kept / name).is_file(), name
    assert strict(kept / ".moe_perf" / "sweep.json")["sweep_id"] == first_id
    assert len(list(kept.glob("tiny/*/metrics.json"))) == 2
    assert not (sweep_dir(repo) / "comparison.json").exists()  # the new sweep compared nothing
    (kept / "comparison.json").unlink()
    rebuilt = subprocess.run(
        [sys.executable, "-m", "moe_perf.compare", str(sweep_dir(repo)), "--sweep", first_id],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert rebuilt.returncode == 0, rebuilt.stderr
    report = strict(kept / "comparison.json")
    assert report["sweep_id"] == first_id and report["groups"][0]["status"] == "compared"
    unknown = subprocess.run(
        [sys.executable, "-m", "moe_perf.compare", str(sweep_dir(repo)), "--sweep", "nope"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert unknown.returncode == 2 and "no sweep nope in" in unknown.stderr
    assert first_id in unknown.stderr and "Traceback" not in unknown.stderr


# ---- records the comparison cannot use --------------------------------------------------------


def test_compare_skips_a_record_of_wrong_types_with_a_note(swept_repo):
    repo = swept_repo
    good = arm_record(repo, "base")
    bad_dir = arm_dir(repo, "base").with_name("pp1-dp1-cp1-ep1-seq64-x-base-r1")
    bad_dir.mkdir()
    steps = [{**s, "step": str(s["step"]), "step_time_s": "0.02"} for s in good["steps"]]
    broken = {**good, "repeat": 1, "summary": "fast", "steps": steps}
    (bad_dir / "metrics.json").write_text(json.dumps(broken))
    (arm_dir(repo, "feat") / "metrics.json").write_text('["valid JSON, not a record"]')
    out = subprocess.run([sys.executable, "-m", "moe_perf.compare", str(sweep_dir(repo))],
                         capture_output=True, text=True, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    assert f"skipped {bad_dir / 'metrics.json'}: not a moe_perf.arm/2 record: summary is " in (
        out.stdout
    )
    assert 'steps[0].step is "1", not int' in out.stdout
    assert "holds a JSON list, not an object" in out.stdout
    (group,) = strict(sweep_dir(repo) / "comparison.json")["groups"]
    assert [r["repeat"] for r in group["runs"]] == [0]  # the good base run only


def test_a_sweep_refused_by_a_range_check_keeps_the_earlier_sweep_as_it_was(swept_repo):
    repo = swept_repo
    before = sorted(str(p.relative_to(sweep_dir(repo))) for p in sweep_dir(repo).rglob("*"))
    multirun = (sweep_dir(repo) / "multirun.yaml").read_text()
    bad = moe_perf(repo, *RUN, "-m", "arm=base,feat", "training.sequence_length=0,64")
    assert bad.returncode == 2, bad.stdout[-3000:] + bad.stderr[-3000:]
    assert "training.sequence_length" in bad.stderr
    after = sorted(str(p.relative_to(sweep_dir(repo))) for p in sweep_dir(repo).rglob("*"))
    assert after == before and (sweep_dir(repo) / "multirun.yaml").read_text() == multirun
