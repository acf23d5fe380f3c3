"""trainer.build: a real C++ extension built per commit in the arms' worktrees.

The end-to-end tests run the real command on a temporary repository whose trainer imports
`spinext`, a Python extension in C++ (setuptools, gcc) whose `work()` spins a loop; the feature
branch spins it four times longer. The in-process tests check the parts on real files, real
git repositories and the real interpreter.
"""

from __future__ import annotations

import contextvars
import json
import os
import signal
import site
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers.command import SMALL_RUN, moe_perf, processes_mentioning, sweep_dir
from helpers.repos import commit, git, make_repo

from moe_perf.launchers.failures import build_error
from moe_perf.launchers.slurm import build_srun_argv
from moe_perf.report.imports import import_warnings
from moe_perf.report.results import ArmRecord
from moe_perf.report.sweep import Sweep
from moe_perf.runner import build_cache, build_isolation, verify_imports
from moe_perf.runner.session import SweepSession, clean_up_dead_sweeps, end_sweep

TAG = "pp1-dp1-cp1-ep1-seq64-fp32"
BASE_LOOPS, FEAT_LOOPS = 3_000_000, 12_000_000

SPIN_CPP = textwrap.dedent(
    """
    #include <Python.h>

    static const long LOOPS = @LOOPS@;

    static PyObject* work(PyObject*, PyObject*) {
        volatile double x = 0.0;  // volatile: the loop is not optimized away
        for (long i = 0; i < LOOPS; ++i) x = x * 0.999 + 1.0;
        return PyFloat_FromDouble(x);
    }

    static PyMethodDef methods[] = {
        {"work", work, METH_NOARGS, "spin"}, {nullptr, nullptr, 0, nullptr}};
    static struct PyModuleDef spin_module = {
        PyModuleDef_HEAD_INIT, "spinext", nullptr, -1, methods};
    PyMODINIT_FUNC PyInit_spinext(void) { return PyModule_Create(&spin_module); }
    """
)
SETUP_PY = textwrap.dedent(
    """
    from setuptools import Extension, setup

    setup(name="spinext", version="0.1", ext_modules=[Extension("spinext", ["spin.cpp"])])
    """
)
# One step = one call of the extension's kernel; contract lines from the one rank.
TRAINER = textwrap.dedent(
    """
    import sys, time
    import yaml
    import spinext
    from moe_perf.common.contract import format_env, format_step

    cfg = yaml.safe_load(open(sys.argv[1]))
    steps = cfg["training"]["max_steps"]
    tokens = cfg["training"]["global_batch"] * cfg["training"]["sequence_length"]
    print(format_env({"torch": None, "cuda": None, "nccl": None, "devices": [], "world_size": 1}),
          flush=True)
    for step in range(1, steps + 1):
        start = time.perf_counter()
        spinext.work()
        seconds = time.perf_counter() - start
        print(format_step(step, steps, step_time_s=seconds, tokens_per_s=tokens / seconds,
                          peak_mem_gib=0.1, loss=0.0), flush=True)
    """
)
# A PEP 517 backend in the tree (pip needs no setuptools nor wheel package to use it): a wheel
# of the extension built in place, and an editable wheel whose .pth puts the tree on sys.path.
BACKEND = textwrap.dedent(
    """
    import base64, glob, hashlib, os, subprocess, sys, tempfile, zipfile

    NAME, VERSION = "spinext", "0.1"

    def _wheel(directory, files, tag="py3-none-any"):
        info = f"{NAME}-{VERSION}.dist-info"
        metadata = f"Metadata-Version: 2.1\\nName: {NAME}\\nVersion: {VERSION}\\n"
        wheel = f"Wheel-Version: 1.0\\nRoot-Is-Purelib: true\\nTag: {tag}\\n"
        files = {**files, f"{info}/METADATA": metadata.encode(), f"{info}/WHEEL": wheel.encode()}
        def line(name, data):
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            return f"{name},sha256={digest.decode()},{len(data)}"
        record = [line(n, d) for n, d in files.items()] + [f"{info}/RECORD,,"]
        name = f"{NAME}-{VERSION}-{tag}.whl"
        with zipfile.ZipFile(os.path.join(directory, name), "w") as zf:
            for path, data in files.items():
                zf.writestr(path, data)
            zf.writestr(f"{info}/RECORD", "\\n".join(record) + "\\n")
        return name

    def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
        with tempfile.TemporaryDirectory() as lib:  # as setuptools does: not into the tree
            subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", lib],
                           check=True)
            built = glob.glob(os.path.join(lib, "spinext*.so"))[0]
            return _wheel(wheel_directory, {os.path.basename(built): open(built, "rb").read()})

    def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
        return _wheel(wheel_directory, {f"__editable__.{NAME}.pth": (os.getcwd() + "\\n").encode()})
    """
)
PYPROJECT = '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'

IN_PLACE = "trainer.build=[python,setup.py,build_ext,--inplace]"
PIP = "python,-m,pip,install,--no-deps,--no-index,--no-build-isolation"
VERIFY = "trainer.verify_imports=[spinext]"


def spin_source(loops: int, statement: str = "x = x * 0.999 + 1.0;") -> str:
    return SPIN_CPP.replace("@LOOPS@", str(loops)).replace("x = x * 0.999 + 1.0;", statement)


def make_ext_repo(path: Path, feat_source: str | None = None, backend: bool = False) -> Path:
    """`main` with the extension and its trainer; `feature` (checked out) changes the kernel."""
    files = {"spin.cpp": spin_source(BASE_LOOPS), "setup.py": SETUP_PY,
             "mytrainer/__main__.py": TRAINER,
             ".gitignore": "build/\n*.so\n__pycache__/\n*.egg-info/\n.build/\n"}  # fmt: skip
    if backend:
        files |= {"backend.py": BACKEND, "pyproject.toml": PYPROJECT}
    make_repo(path, files)
    git(path, "checkout", "-q", "-b", "feature")
    commit(path, {"spin.cpp": feat_source or spin_source(FEAT_LOOPS)}, "feature: a slower kernel")
    return path


def records(repo: Path) -> dict[str, dict]:
    """{arm directory name: its record} of the repository's latest sweep."""
    found = sweep_dir(repo).glob("tiny/*/metrics.json")
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(found)}


def spinext_entry(record: dict) -> dict:
    return next(e for e in record["imports"] if e["module"] == "spinext")


def assert_worktrees_gone(repo: Path) -> None:
    assert len(git(repo, "worktree", "list").splitlines()) == 1
    assert not (sweep_dir(repo) / ".moe_perf" / "worktrees.json").exists()


def step_time_pct(repo: Path) -> float:
    comparison = json.loads((sweep_dir(repo) / "comparison.json").read_text())
    return comparison["groups"][0]["difference"]["step_time_s"]["pct"]


# ---- end to end ------------------------------------------------------------------------------


@pytest.mark.slow
def test_each_commit_is_built_once_in_its_worktree_and_each_arm_imports_its_own(tmp_path):
    repo = make_ext_repo(tmp_path / "repo")
    cache = tmp_path / "build-cache"
    # {python}: the arms' interpreter (quoted: braces are Hydra's dict syntax)
    args = [*SMALL_RUN, 'trainer.build=["{python}",setup.py,build_ext,--inplace]', VERIFY,
            f"trainer.build_cache={cache}"]  # fmt: skip
    result = moe_perf(repo, *args, "-m", "repeat=0,1,2", "arm=base,feat")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    found = records(repo)
    assert len(found) == 6
    # built once per commit, by its first arm; its log there only
    assert out.count(": building ") == 2
    for name, record in found.items():
        first = name.endswith("-r0")
        assert record["build"]["status"] == "ok" and record["build"]["reused"] is not first
        assert record["build"]["built_by"] == f"{record['arm']}-r0"
        assert (sweep_dir(repo) / "tiny" / name / "build.log").exists() is first
        assert record["build"]["wall_s"] > 0 if first else record["build"]["wall_s"] == 0
    log = (sweep_dir(repo) / "tiny" / f"{TAG}-base-r0" / "build.log").read_text()
    assert "spin.cpp" in log and "spinext" in log  # the compiler ran there
    # every arm loads the extension built in its own commit's worktree
    by_arm: dict[str, set] = {"base": set(), "feat": set()}
    for record in found.values():
        entry = spinext_entry(record)
        assert entry["in_worktree"] and entry["file"].startswith(record["build"]["worktree"])
        by_arm[record["arm"]].add((entry["file"], entry["sha256"]))
    assert len(by_arm["base"]) == len(by_arm["feat"]) == 1  # one worktree, one build per commit
    (base_file, base_hash), (feat_file, feat_hash) = by_arm["base"].pop(), by_arm["feat"].pop()
    assert base_file != feat_file and base_hash != feat_hash
    assert "**Warning**" not in (sweep_dir(repo) / "comparison.md").read_text()
    # four times the loop: the slowdown is found (by far more than any load on the machine)
    assert step_time_pct(repo) > 50, out[-3000:]
    assert_worktrees_gone(repo)
    stored = [r["build"]["cache"] for r in found.values() if not r["build"]["reused"]]
    assert all(c["stored"] and not c["hit"] for c in stored)

    # the next sweep finds both commits' builds in the cache: nothing is compiled again
    again = moe_perf(repo, *args, "-m", "arm=base,feat")
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert ": building " not in again.stdout
    for arm, record in records(repo).items():
        assert record["build"]["cache"]["hit"], arm
        assert "restored from the build cache" in (sweep_dir(repo) / "tiny" / arm / "build.log"
                                                   ).read_text()  # fmt: skip
        assert spinext_entry(record)["sha256"] == (base_hash if "base" in arm else feat_hash)
    assert step_time_pct(repo) > 50
    assert_worktrees_gone(repo)


@pytest.mark.slow
def test_a_broken_build_fails_its_arm_with_the_compiler_error_and_the_sweep_goes_on(tmp_path):
    broken = spin_source(FEAT_LOOPS, "x = x * 0.999 + undefined_name;")
    repo = make_ext_repo(tmp_path / "repo", feat_source=broken)
    result = moe_perf(repo, *SMALL_RUN, IN_PLACE, VERIFY, "-m", "arm=base,feat")
    assert result.returncode == 3, (result.stdout + result.stderr)[-4000:]
    found = records(repo)
    base, feat = found[f"{TAG}-base"], found[f"{TAG}-feat"]
    assert base["status"] == "ok" and base["summary"]["steps_measured"] == 5
    assert feat["status"] == "failed" and feat["build"]["status"] == "failed"
    # the reason is gcc's own line, and its log is kept
    assert "spin.cpp:" in feat["failure"] and "error:" in feat["failure"]
    assert "undefined_name" in feat["failure"]
    feat_dir = sweep_dir(repo) / "tiny" / f"{TAG}-feat"
    assert "undefined_name" in (feat_dir / "build.log").read_text()
    assert (feat_dir / "console.log").read_text().startswith("not launched: build failed")
    assert feat["build"]["exit_code"] not in (0, None) and feat["exit_code"] is None
    assert_worktrees_gone(repo)


def throwaway_venv(path: Path) -> Path:
    """A virtual environment of its own that sees this project's packages (through a .pth
    that adds this interpreter's site directories), so what is installed there stays there."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    lines = [f"import site; site.addsitedir({d!r})" for d in site.getsitepackages()]
    Path(purelib.stdout.strip(), "zz_project.pth").write_text("\n".join(lines) + "\n")
    return python


def installed(python: Path | str) -> list[str]:
    code = "import importlib.metadata as m; print(sorted(str(d._path) for d in m.distributions()))"
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                          check=True).stdout  # fmt: skip


@pytest.mark.slow
def test_a_build_that_installs_into_the_shared_environment_is_refused(tmp_path):
    repo = make_ext_repo(tmp_path / "repo", backend=True)
    python = throwaway_venv(tmp_path / "venv")
    ours = installed(sys.executable)
    result = subprocess.run(
        [str(python), "-m", "moe_perf", *SMALL_RUN, f"trainer.build=[{PIP},-e,.]", VERIFY,
         "-m", "arm=base,feat"],
        cwd=repo, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 3, out[-4000:]
    for record in records(repo).values():  # the editable install made both arms one branch
        assert record["status"] == "failed" and record["build"]["status"] == "refused", out
        assert "changed the environment both arms share" in record["failure"]
        assert "installed spinext 0.1" in record["failure"]
        assert f"{python} -m pip uninstall spinext" in record["failure"]
        assert '--target,"{worktree}/.build"' in record["failure"]  # how to build instead
        assert (Path(record["arm_dir"]) / "console.log").read_text().startswith("not launched")
    assert "spinext-0.1.dist-info" in installed(python)  # it did install there, truly
    assert installed(sys.executable) == ours  # and this project's environment is untouched
    assert_worktrees_gone(repo)


@pytest.mark.slow
def test_a_per_arm_prefix_build_is_its_arms_own(tmp_path):
    repo = make_ext_repo(tmp_path / "repo", backend=True)
    # quoted: braces are Hydra's dict syntax
    prefix = [f'trainer.build=[{PIP},--target,"{{worktree}}/.build",.]',
              '+trainer.env.PYTHONPATH="{worktree}/.build"']  # fmt: skip
    result = moe_perf(repo, *SMALL_RUN, *prefix, VERIFY, "-m", "arm=base,feat")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    files = set()
    for record in records(repo).values():
        entry = spinext_entry(record)
        assert entry["file"].startswith(record["build"]["worktree"] + "/.build/spinext")
        files.add(entry["sha256"])
    assert len(files) == 2 and step_time_pct(repo) > 50


@pytest.mark.slow
def test_ctrl_c_during_a_build_stops_it_and_removes_the_worktrees(tmp_path):
    repo = make_ext_repo(tmp_path / "repo")
    marker = f"build-sleeps-{os.getpid()}"  # in the build's command line
    sleeper = f'trainer.build=[python,-c,"import time; time.sleep(300)  # {marker}"]'
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_perf", *SMALL_RUN, sleeper, "-m", "arm=base,feat"],
        cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a terminal
    )  # fmt: skip
    log = sweep_dir(repo) / "tiny" / f"{TAG}-base" / "build.log"
    deadline = time.monotonic() + 90
    while len(processes_mentioning(marker)) < 2:  # the runner's command line, and the build's
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    assert log.exists()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert processes_mentioning(marker) == []
    base = records(repo)[f"{TAG}-base"]
    assert base["failure"].startswith("interrupted") and base["build"]["status"] == "interrupted"
    assert (log.parent / "console.log").read_text().startswith("not launched: interrupted")
    assert f"{TAG}-feat" not in records(repo)  # the sweep stopped there
    assert_worktrees_gone(repo)


@pytest.mark.slow
def test_dry_run_shows_each_arms_build_and_builds_nothing(tmp_path):
    repo = make_ext_repo(tmp_path / "repo")
    result = moe_perf(repo, *SMALL_RUN, IN_PLACE, "dry_run=true", "-m", "arm=base,feat")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for arm, ref in (("base", "main"), ("feat", "feature")):
        line = next(x for x in result.stdout.splitlines() if f"{arm}: build (in <worktree>" in x)
        assert f"before the first arm of {git(repo, 'rev-parse', ref)[:10]}" in line
        assert line.endswith("): python setup.py build_ext --inplace")
    assert not list(sweep_dir(repo).rglob("build.log"))
    assert_worktrees_gone(repo)


# ---- the parts, in process -------------------------------------------------------------------


@pytest.mark.slow
def test_a_compilers_first_error_is_the_reason(tmp_path):
    source = tmp_path / "kernel.cpp"
    source.write_text("int f() { return missing_a; }\nint g() { return missing_b; }\n")
    proc = subprocess.run(["g++", "-c", str(source), "-o", str(tmp_path / "k.o")],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode != 0
    log = f"running build_ext\n{proc.stderr}error: command '/usr/bin/g++' failed with exit code 1\n"
    reason = build_error(log)
    assert reason.startswith(f"{source}:1:") and "missing_a" in reason
    # no compiler line: the exception a build script died of
    proc = subprocess.run([sys.executable, "-c", "import nonexistent_module"],
                          capture_output=True, text=True)  # fmt: skip
    assert build_error(proc.stderr) == "ModuleNotFoundError: No module named 'nonexistent_module'"


def test_the_snapshot_sees_a_new_distribution_outside_the_arms_own_directories(tmp_path):
    shared, own = tmp_path / "shared", tmp_path / "worktree" / ".build"
    shared.mkdir()
    own.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(own), str(shared)])}
    before = build_isolation.snapshot(env, [tmp_path / "worktree"])
    for where in (own, shared):  # a real distribution, as pip leaves one
        (where / "plant-1.0.dist-info").mkdir()
        (where / "plant-1.0.dist-info" / "METADATA").write_text("Name: plant\nVersion: 1.0\n")
    changed = build_isolation.changes(before, build_isolation.snapshot(env, [own.parent]))
    assert changed == [f"installed plant 1.0 ({shared / 'plant-1.0.dist-info'})"]
    assert "pip uninstall plant" in build_isolation.refusal(changed)


def test_imports_are_resolved_without_running_the_modules(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("raise SystemExit('never imported')\n")
    (tmp_path / "pkg" / "kernel.py").write_text("raise SystemExit('never imported')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    entries = verify_imports.probe_modules(["pkg", "pkg.kernel", "absent_mod", "json"],
                                           tmp_path, env)  # fmt: skip
    pkg, kernel, absent, stdlib = entries
    assert pkg["hashed"] == "package directory" and pkg["in_worktree"]
    assert kernel["file"] == str(tmp_path / "pkg" / "kernel.py") and kernel["hashed"] == "file"
    assert kernel["sha256"] == verify_imports.file_sha256(tmp_path / "pkg" / "kernel.py")
    assert absent["error"] == "not found" and absent["sha256"] is None
    assert not stdlib["in_worktree"]
    before = pkg["sha256"]
    (tmp_path / "pkg" / "kernel.py").write_text("X = 2\n")
    assert verify_imports.probe_modules(["pkg"], tmp_path, env)[0]["sha256"] != before


def test_the_comparison_says_when_two_commits_loaded_one_file():
    def record(arm, sha, file, digest):
        entry = {"module": "my_ext", "listed_by": "trainer.verify_imports", "file": file,
                 "sha256": digest}  # fmt: skip
        return ArmRecord(arm=arm, sha=sha, extra={"imports": [entry]})

    shared = "/venv/site-packages/my_ext.so"
    warned = import_warnings([record("base", "a", shared, "h"), record("feat", "b", shared, "h")])
    assert len(warned) == 1 and f"both loaded my_ext from {shared}" in warned[0]
    own = [record("base", "a", "/a/my_ext.so", "h1"), record("feat", "b", "/b/my_ext.so", "h2")]
    assert import_warnings(own) == []
    same = [record("base", "a", "/a/my_ext.so", "h"), record("feat", "b", "/b/my_ext.so", "h")]
    assert "byte-identical" in import_warnings(same)[0]
    one_commit = [record("base", "a", shared, "h"), record("feat", "a", shared, "h")]
    assert import_warnings(one_commit) == []  # an A/A run loads one file by design


def test_a_commits_worktree_lives_until_the_sweep_ends(tmp_path):
    repo = make_repo(tmp_path / "repo")
    sha = git(repo, "rev-parse", "HEAD")
    sweep = Sweep("s1", str(tmp_path / "sweep"), str(repo), {}, {"base": sha, "feat": sha}, "")
    session = SweepSession(active=sweep)
    path = session.worktree_for(sha)
    assert SweepSession(active=sweep).worktree_for(sha) == path  # another process of the sweep
    session.end()
    assert not path.parent.exists() and len(git(repo, "worktree", "list").splitlines()) == 1
    # a runner killed mid-sweep leaves its worktree: the next sweep removes it
    left = SweepSession(active=sweep).worktree_for(sha)
    clean_up_dead_sweeps(repo, 1.0)
    assert not left.exists()
    end_sweep(tmp_path / "sweep")  # nothing left to remove: no error


def test_the_command_serves_one_session_to_its_task_and_callback():
    """What main() serves is what the Hydra task and SweepStart get; none served (a job in a
    process of its own) gets a new one, kept for that context; serving ends with its block."""

    def in_a_fresh_context():
        served = SweepSession()
        with served.serving():
            assert SweepSession.of_command() is served
            assert SweepSession.of_command() is served  # the task's and the callback's
        own = SweepSession.of_command()
        assert own is not served and SweepSession.of_command() is own

    contextvars.copy_context().run(in_a_fresh_context)


def test_the_cache_key_follows_commit_command_and_toolchain(tmp_path):
    tools = build_cache.toolchain(dict(os.environ))
    assert tools["python"][0] == sys.executable and "__version__" in tools["torch"]
    key = build_cache.build_key("a" * 40, ["python", "setup.py"], {}, tools)
    assert key == build_cache.build_key("a" * 40, ["python", "setup.py"], {}, tools)
    for other in (build_cache.build_key("b" * 40, ["python", "setup.py"], {}, tools),
                  build_cache.build_key("a" * 40, ["python", "setup.py", "-j8"], {}, tools),
                  build_cache.build_key("a" * 40, ["python", "setup.py"], {"X": "1"}, tools),
                  build_cache.build_key("a" * 40, ["python", "setup.py"], {},
                                        {**tools, "variables": {"CXX": "clang++"}})):  # fmt: skip
        assert other != key


def test_the_cache_restores_what_the_build_left_in_the_worktree(tmp_path):
    repo = make_repo(tmp_path / "repo", {"src.c": "x\n", "tracked.txt": "t\n",
                                         ".gitignore": "out/\n"})  # fmt: skip
    (repo / "out").mkdir()
    (repo / "out" / "lib.so").write_bytes(b"\x7fELF built")
    (repo / "new.txt").write_text("untracked\n")
    (repo / "tracked.txt").write_text("generated\n")
    assert build_cache.produced_files(repo) == (["new.txt", "out/lib.so", "tracked.txt"], [])
    entry = build_cache.store(tmp_path / "cache", "k1", repo, {"sha": "x"})
    assert entry is not None and build_cache.store(tmp_path / "cache", "k1", repo, {}) is None
    fresh = make_repo(tmp_path / "fresh", {"src.c": "x\n", "tracked.txt": "t\n"})
    assert build_cache.restore(tmp_path / "cache", "k1", fresh)["sha"] == "x"
    assert (fresh / "out" / "lib.so").read_bytes() == b"\x7fELF built"
    assert (fresh / "tracked.txt").read_text() == "generated\n"
    assert build_cache.restore(tmp_path / "cache", "k2", fresh) is None


def test_under_slurm_the_build_is_one_task_or_one_per_node():
    env = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}
    once = build_srun_argv(["make"], nnodes=2, every_node=False, arm_label="t-base",
                           launcher={"cpus_per_task": 16}, env=env)  # fmt: skip
    assert once[:4] == ["srun", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1"]
    assert "--cpus-per-task=16" in once and "--overlap" in once and once[-1] == "make"
    every = build_srun_argv(["make"], nnodes=2, every_node=True, arm_label="t-base",
                            launcher={}, env={"SLURM_JOB_ID": "7"})  # fmt: skip
    assert every[1:3] == ["--nodes=2", "--ntasks=2"] and "--overlap" not in every
