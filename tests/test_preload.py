"""launcher.preload: one-process arms forked from an interpreter that imported torch once per
sweep (moe_perf/launchers/forkserver.py, preload.py). A forked arm must be what `python ARGV`
would have been (its argv, cwd, environment, path, streams, exit status, signals), run its own
worktree's code, and leave no process behind, however it ends.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.command import SMALL_RUN, assert_ok, moe_perf, sweep_dir
from helpers.repos import commit, copy_of_moe_perf, git, make_ab_repo, trainer_files

from moe_perf.launchers.preload import FORKSERVER, Preloader, read_info
from moe_perf.launchers.process import trainer_env

TAG = "pp1-dp1-cp1-ep1-seq64-fp32"
# what a probe prints of itself: the same through the server as from a fresh interpreter
PROBE = """\
import json, os, sys
print(json.dumps({
    "name": __name__, "argv": sys.argv[1:], "cwd": os.getcwd(),
    "env": os.environ.get("PROBE_VALUE"), "path0": sys.path[0],
    "extra_on_path": os.environ["PROBE_EXTRA"] in sys.path,
    "stdin": sys.stdin.read(), "helper": __import__("probe_helper").WHERE,
}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
code = os.environ.get("PROBE_EXIT")
if code == "raise":
    raise RuntimeError("probe failed")
if code:
    sys.exit(int(code))
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


@pytest.fixture
def probe_dir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    (work / "pkg").mkdir(parents=True)
    (work / "probe.py").write_text(PROBE)
    (work / "pkg" / "__init__.py").write_text("")
    (work / "pkg" / "probe.py").write_text(PROBE)
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "probe_helper.py").write_text("WHERE = __file__\n")
    return work


@pytest.fixture
def preloader():
    server = Preloader(("json", "email.message"))  # stdlib: quick to import
    yield server
    server.stop()


def through(preloader: Preloader | None, argv: list[str], cwd: Path, arm_dir: Path,
            added: dict[str, str]) -> tuple[list[str], dict[str, str]]:  # fmt: skip
    """The launch's command and whole environment as the runner makes them (`added`: what the
    launch adds to the environment; `cwd` stands for the worktree)."""
    command = [sys.executable, *argv]
    if preloader is not None:
        command = preloader.argv(command, cwd, arm_dir, added, None)
    return command, trainer_env(cwd, arm_dir, "", added)


def launch(preloader: Preloader | None, argv: list[str], cwd: Path, info: Path,
           **env: str) -> subprocess.CompletedProcess:  # fmt: skip
    extra = str(cwd.parent / "extra")
    added = {"PROBE_EXTRA": extra, "PYTHONPATH": extra, **env}
    command, whole = through(preloader, argv, cwd, info.parent, added)
    return subprocess.run(command, cwd=cwd, env=whole, input="from stdin", capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip


@pytest.mark.parametrize("argv", [["probe.py", "a", "--b"], ["-m", "pkg.probe", "a", "--b"]])
def test_a_forked_arm_is_what_python_argv_would_be(preloader, probe_dir, tmp_path, argv):
    plain = launch(None, argv, probe_dir, tmp_path / "plain.json", PROBE_VALUE="v")
    forked = launch(preloader, argv, probe_dir, tmp_path / "preload.json", PROBE_VALUE="v")
    assert plain.returncode == forked.returncode == 0, forked.stderr
    assert json.loads(forked.stdout) == json.loads(plain.stdout)
    assert json.loads(forked.stdout)["name"] == "__main__"
    assert forked.stderr == plain.stderr == "to stderr\n"
    info = read_info(tmp_path)
    assert info["preloaded"] is True and info["server_pid"] == preloader.server.proc.pid
    assert info["modules"] == ["json", "email.message"]


def test_exit_status_and_uncaught_exceptions_are_the_childs(preloader, probe_dir, tmp_path):
    for code in ("0", "3", "raise"):
        plain = launch(None, ["probe.py"], probe_dir, tmp_path / "x.json", PROBE_EXIT=code)
        forked = launch(preloader, ["probe.py"], probe_dir, tmp_path / "preload.json",
                        PROBE_EXIT=code)  # fmt: skip
        assert forked.returncode == plain.returncode == {"0": 0, "3": 3, "raise": 1}[code]
        if code == "raise":
            assert forked.stderr.splitlines()[-1] == "RuntimeError: probe failed"


def test_a_forked_arm_starts_with_the_servers_objects_frozen(preloader, probe_dir, tmp_path):
    """The server's imports are out of the collector's reach in its children (gc.freeze), so a
    child's collections neither walk them nor write to the pages it shares with the server; a
    fresh interpreter freezes nothing."""
    (probe_dir / "frozen.py").write_text("import gc\nprint(gc.get_freeze_count())\n")
    plain = launch(None, ["frozen.py"], probe_dir, tmp_path / "plain.json")
    forked = launch(preloader, ["frozen.py"], probe_dir, tmp_path / "preload.json")
    assert plain.returncode == forked.returncode == 0, forked.stderr
    assert int(plain.stdout) == 0
    assert int(forked.stdout) > 1000  # json and email's modules, functions and classes


def test_one_server_serves_every_arm_of_its_environment(preloader, probe_dir, tmp_path):
    pids = set()
    for value in ("one", "two"):  # an arm's own values (PYTHONPATH among them) do not count
        launch(preloader, ["probe.py"], probe_dir, tmp_path / "preload.json", PROBE_VALUE="v",
               MASTER_PORT=value)  # fmt: skip
        pids.add(read_info(tmp_path)["server_pid"])
    assert len(pids) == 1
    first = pids.pop()
    launch(preloader, ["probe.py"], probe_dir, tmp_path / "preload.json", PROBE_VALUE="other")
    assert read_info(tmp_path)["server_pid"] != first  # another environment, another server
    assert gone_within(first, 10)


def test_a_copy_of_a_preloaded_package_ahead_on_the_path_runs_plain(preloader, probe_dir, tmp_path):
    (probe_dir / "email").mkdir()  # the arm's own `email` would shadow the server's
    (probe_dir / "email" / "__init__.py").write_text("")
    result = launch(preloader, ["probe.py"], probe_dir, tmp_path / "preload.json")
    assert result.returncode == 0 and json.loads(result.stdout)["name"] == "__main__"
    assert "launched without the preloaded interpreter" in result.stderr
    info = read_info(tmp_path)
    assert info["preloaded"] is False
    assert info["why"] == f"{probe_dir / 'email'} would be imported instead of the preloaded email"


def test_a_server_that_cannot_import_leaves_the_arm_to_run_plain(probe_dir, tmp_path):
    broken = Preloader(("no_such_module_anywhere",))
    try:
        result = launch(broken, ["probe.py"], probe_dir, tmp_path / "preload.json")
    finally:
        broken.stop()
    assert result.returncode == 0 and json.loads(result.stdout)["name"] == "__main__"
    info = read_info(tmp_path)
    assert info["preloaded"] is False and "is gone" in info["why"]


def test_sigterm_to_the_launch_ends_the_child_the_same_way(preloader, probe_dir, tmp_path):
    (probe_dir / "sleeper.py").write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    argv, env = through(preloader, ["sleeper.py"], probe_dir, tmp_path, {})
    launch_proc = subprocess.Popen(argv, cwd=probe_dir, env=env, stdout=subprocess.PIPE, text=True)
    assert launch_proc.stdout.readline() == "up\n"
    child = read_info(tmp_path)["pid"]
    launch_proc.send_signal(signal.SIGTERM)
    assert launch_proc.wait(10) == -signal.SIGTERM
    assert gone_within(child, 10)


def test_a_killed_launch_takes_its_child_with_it(preloader, probe_dir, tmp_path):
    (probe_dir / "stubborn.py").write_text(
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('up', flush=True)\ntime.sleep(60)\n"
    )
    argv, env = through(preloader, ["stubborn.py"], probe_dir, tmp_path, {})
    launch_proc = subprocess.Popen(argv, cwd=probe_dir, env=env, stdout=subprocess.PIPE, text=True)
    assert launch_proc.stdout.readline() == "up\n"
    child = read_info(tmp_path)["pid"]
    server = read_info(tmp_path)["server_pid"]
    launch_proc.kill()
    launch_proc.wait(10)
    assert gone_within(child, 10)  # the server saw its launch go
    (probe_dir / "quick.py").write_text("print('ok')\n")
    quick, env = through(preloader, ["quick.py"], probe_dir, tmp_path, {})
    assert subprocess.run(quick, cwd=probe_dir, env=env, capture_output=True, text=True,
                          timeout=30).stdout == "ok\n"  # fmt: skip
    assert read_info(tmp_path)["server_pid"] == server  # the same server serves the next one


def test_the_server_exits_with_its_runner(tmp_path):
    """A runner killed outright (SIGKILL) leaves no server running, and no server directory."""
    runner = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom pathlib import Path\n"
         "from moe_perf.launchers.preload import Preloader\n"
         "p = Preloader(('json',)); p.warm(Path('.'), Path('.'), {}, None)\n"
         "print(p.server.proc.pid, p.server.directory, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    pid, directory = runner.stdout.readline().split()
    server, directory = int(pid), Path(directory)
    assert alive(server)
    deadline = time.monotonic() + 30
    while not (directory / "socket").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # serving: the directory holds its socket and log
    assert sorted(p.name for p in directory.iterdir()) == ["server.log", "socket"]
    runner.kill()
    runner.wait(10)
    assert gone_within(server, 10)
    assert not directory.exists()


def test_forkserver_is_run_by_path_and_imports_no_moe_perf():
    """The server's modules are what every arm shares: none of moe_perf's, which each arm
    imports from its own worktree."""
    source = FORKSERVER.read_text()
    assert "moe_perf" not in "".join(
        line for line in source.splitlines() if line.startswith(("import ", "from "))
    )


# ---- through the real command -----------------------------------------------------------------


@pytest.mark.slow
def test_a_sweep_of_forked_arms_runs_each_commits_own_code(tmp_path):
    """The small trainer's sweep with launcher.preload: the feature branch's slowdown is found,
    every arm came from one server, and nothing is left running."""
    repo = make_ab_repo(tmp_path / "repo", slowdown_s=0.05)
    result = moe_perf(repo, *SMALL_RUN, "launcher.preload=true",
                      "launcher.preload_modules=[numpy,yaml]", "-m", "arm=base,feat",
                      "repeat=0,1")  # fmt: skip
    assert_ok(result)
    arms = sweep_dir(repo) / "tiny"
    infos = {arm: read_info(arms / f"{TAG}-{arm}") for arm in ("base-r0", "feat-r0", "base-r1",
                                                               "feat-r1")}  # fmt: skip
    assert all(info["preloaded"] for info in infos.values()), infos
    (server,) = {info["server_pid"] for info in infos.values()}
    assert len({info["pid"] for info in infos.values()}) == 4
    record = json.loads((arms / f"{TAG}-feat-r1" / "metrics.json").read_text())
    assert record["preload"] == infos["feat-r1"]
    comparison = json.loads((sweep_dir(repo) / "comparison.json").read_text())
    (group,) = comparison["groups"]
    assert group["verdict"]["step_time_s"]["word"] == "DIFFERENT"
    assert group["difference"]["step_time_s"]["words"] == "slower"
    assert gone_within(server, 10)
    assert not any(alive(info["pid"]) for info in infos.values())


@pytest.mark.slow
def test_a_crashing_forked_arm_fails_alone_with_its_exit_status(tmp_path):
    repo = make_ab_repo(tmp_path / "repo", feat=trainer_files(exit_after_step=2))
    result = moe_perf(repo, *SMALL_RUN, "launcher.preload=true",
                      "launcher.preload_modules=[numpy]", "-m", "arm=base,feat")  # fmt: skip
    assert result.returncode != 0
    arms = sweep_dir(repo) / "tiny"
    base = json.loads((arms / f"{TAG}-base" / "metrics.json").read_text())
    feat = json.loads((arms / f"{TAG}-feat" / "metrics.json").read_text())
    assert base["status"] == "ok" and base["preload"]["preloaded"]
    assert feat["status"] == "failed" and feat["exit_code"] == 3 and feat["preload"]["preloaded"]
    assert "exit" in feat["failure"] and "3" in feat["failure"]


@pytest.mark.slow
def test_the_reference_trainer_forked_from_torch_trains_as_a_fresh_process(tmp_path):
    """The default modules (torch, dynamo, inductor) preloaded: each arm runs its own commit's
    reference trainer (the runner's copy is never the one that runs), with the same losses as a
    fresh interpreter."""
    repo = copy_of_moe_perf(tmp_path / "repo")
    train = repo / "moe_perf" / "trainer" / "train.py"
    plant_at = "def bench_hook() -> None:\n"
    git(repo, "checkout", "-q", "-b", "slower-step")
    commit(repo, {str(train.relative_to(repo)): train.read_text().replace(
        plant_at, plant_at + "    time.sleep(0.25)\n")}, "plant a sleep in every step")  # fmt: skip
    small = ["training.sequence_length=64", "training.global_batch=4", "training.max_steps=4",
             "wandb.mode=disabled", "timeout_s=240", "compare.max_pairs=1"]  # fmt: skip
    result = moe_perf(tmp_path, f"repo={repo}", *small, "launcher.preload=true",
                      "-m", "arm=base,feat")  # fmt: skip
    assert_ok(result)
    arms = tmp_path / "outputs" / "validate-performance" / "tiny"
    base, feat = (json.loads((arms / f"{TAG}-{arm}" / "metrics.json").read_text())
                  for arm in ("base", "feat"))  # fmt: skip
    assert base["preload"]["preloaded"] and feat["preload"]["preloaded"]
    assert base["preload"]["modules"] == ["torch", "torch._dynamo", "torch._inductor.compile_fx"]
    assert feat["summary"]["step_time_s"] > base["summary"]["step_time_s"] + 0.2
    plain = moe_perf(tmp_path, f"repo={repo}", *small, "arm=base", "hydra.run.dir=plain")
    assert_ok(plain)
    fresh = json.loads((tmp_path / "plain" / "metrics.json").read_text())
    assert "preload" not in fresh
    assert [s["loss"] for s in fresh["steps"]] == [s["loss"] for s in base["steps"]]


@pytest.mark.slow
def test_the_dry_run_says_which_arms_would_be_forked(tmp_path):
    repo = make_ab_repo(tmp_path / "repo")
    said = "launcher.preload: run as a fork of the sweep's interpreter that imported numpy once"
    for overrides, forked in ((["launcher.preload=true"], True), ([], False),
                              (["launcher.preload=true", "mesh=ep2"], False)):  # fmt: skip
        result = moe_perf(repo, *SMALL_RUN, "launcher.preload_modules=[numpy]", "dry_run=true",
                          "arm=feat", *overrides)  # fmt: skip
        assert_ok(result)
        assert (said in result.stdout) is forked, overrides


@pytest.mark.slow
def test_an_interrupted_sweep_leaves_no_server_launch_or_child(tmp_path):
    repo = make_ab_repo(tmp_path / "repo", feat=trainer_files(sleep_s=1.0))
    args = [arg for arg in SMALL_RUN if not arg.startswith("training.max_steps")]
    runner = subprocess.Popen(
        [sys.executable, "-m", "moe_perf", *args, "training.max_steps=60", "launcher.preload=true",
         "launcher.preload_modules=[numpy]", "launcher.kill_grace_s=2", "-m", "arm=feat,base"],
        cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a terminal
    )  # fmt: skip
    for line in runner.stdout:
        if "[feat] step 2/60" in line:
            break
    info = read_info(sweep_dir(repo) / "tiny" / f"{TAG}-feat")
    assert info["preloaded"] and alive(info["pid"]) and alive(info["server_pid"])
    runner.send_signal(signal.SIGINT)
    output = runner.communicate(timeout=60)[0]
    assert runner.returncode != 0 and "interrupted" in output, (runner.returncode, output[-4000:])
    assert gone_within(info["pid"], 10) and gone_within(info["server_pid"], 10)


@pytest.mark.parametrize(
    ("overrides", "forked"),
    [
        (["training.device=cuda"], True),  # unset: the reference trainer on a GPU
        (["training.device=cpu"], False),
        (["training.device=cuda", "trainer=torchtitan"], False),  # not measured there
        (["training.device=cuda", "launcher=slurm"], False),  # srun runs the arm elsewhere
        (["training.device=cuda", "launcher.preload=false"], False),
        (["training.device=cpu", "launcher.preload=true"], True),
        (["training.device=cuda", "trainer=torchtitan", "launcher.preload=true"], True),
    ],
)
def test_unset_preload_forks_the_reference_trainers_gpu_arms(overrides, forked):
    from helpers.compose import composed

    from moe_perf.launchers.preload import wanted

    assert wanted(composed(*overrides)) is forked
    # a sweep of one arm has nothing to share the server with: only when asked
    assert wanted(composed(*overrides), several_arms=False) is (
        "launcher.preload=true" in overrides
    )
