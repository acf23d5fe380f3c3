"""torch.compile's caches shared by the arms of a repository: a real compiled A/B sweep.

One sweep of the tiny model, compiled, against a branch whose loss differs by one op. The base
arm compiles cold into the sweep's cache directory; the feat arm (its own worktree, its own
code) loads every unchanged graph from it and recompiles the changed one. Both facts come from
the counters the trainer recorded (torch's fxgraph_cache_hit/miss), not from timings.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.command import assert_ok, moe_perf, sweep_dir
from helpers.repos import ROOT, copy_of_moe_perf, git, make_repo

from moe_perf.runner import compile_cache

LOSS = "    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), labels_BS.flatten())\n"

# bf16: compiled, torch._grouped_mm's meta function on CPU accepts bf16 only; one layer and
# short sequences keep the cold CPU compile of the base arm to some tens of seconds
SMALL = ["dtype=bf16", "trainer.compile=true", "model.num_layers=1",
         "training.sequence_length=32", "training.global_batch=2", "training.max_steps=2",
         "wandb.mode=disabled", "timeout_s=300", "compare.max_pairs=1"]  # fmt: skip


@pytest.mark.slow
def test_the_second_arm_loads_unchanged_graphs_and_recompiles_the_changed_one(tmp_path):
    repo = copy_of_moe_perf(tmp_path / "repo")
    model = repo / "moe_perf" / "trainer" / "model.py"
    text = model.read_text()
    assert text.count(LOSS) == 1, "the changed op goes in model.cross_entropy"
    git(repo, "checkout", "-q", "-b", "scaled-loss")
    model.write_text(
        text.replace(LOSS, LOSS.replace("labels_BS.flatten())", "labels_BS.flatten()) * 2.0"))
    )
    git(repo, "commit", "-q", "-am", "the loss doubled: one compiled graph changes")

    cache = tmp_path / "compile-cache"
    result = moe_perf(tmp_path, f"repo={repo}", f"compile_cache={cache}", *SMALL,
                      "-m", "arm=base,feat", timeout=400)  # fmt: skip
    assert_ok(result)
    arms = sweep_dir(tmp_path) / "tiny"
    base, feat = (json.loads((arms / f"pp1-dp1-cp1-ep1-seq32-bf16-{arm}" / "metrics.json")
                             .read_text()) for arm in ("base", "feat"))  # fmt: skip
    assert base["status"] == feat["status"] == "ok"
    for record in (base, feat):
        assert record["compile_cache"]["dir"] == str(cache)
        assert Path(record["compile_cache"]["inductor_dir"]).parent == cache
    b, f = base["compile_cache"]["counters"], feat["compile_cache"]["counters"]
    assert b.get("fxgraph_cache_hit", 0) == 0 and b["fxgraph_cache_miss"] > 0  # cold
    assert f["fxgraph_cache_hit"] > 0  # the unchanged layer graphs, from base's entries
    assert 0 < f["fxgraph_cache_miss"] < b["fxgraph_cache_miss"]  # the changed loss only
    # AOTAutograd's entries too, the MoE graphs with the trainer's custom autograd Functions
    # included (runtime.cache_custom_autograd_functions): none bypassed, feat loads them
    assert b.get("autograd_cache_bypass", 0) == f.get("autograd_cache_bypass", 0) == 0
    assert f["autograd_cache_hit"] > 0
    assert (cache / "inductor").is_dir()
    # the start-up timeline is in order, and the console names the cache and its counts
    marks = list(feat["startup_marks_s"].values())
    assert marks == sorted(marks) and feat["startup_marks_s"]["step1_done"] > 0
    # where the compiles' time went, by dynamo's clocks: the cold arm traced and compiled
    # (inductor's forward and backward compilers ran), within dynamo's own total
    phases = base["startup_compile"]["phases_s"]
    assert 0 < phases["backend"] <= phases["dynamo_total"]
    assert phases["inductor_forward"] > 0 and phases["inductor_backward"] > 0
    assert f"compile cache {cache}: FX graphs {f['fxgraph_cache_hit']} hit" in result.stdout


@pytest.mark.slow
def test_auto_is_one_directory_per_repository_shared_by_its_worktrees(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    repo = copy_of_moe_perf(tmp_path / "repo")
    other = copy_of_moe_perf(tmp_path / "other")
    git(repo, "worktree", "add", "-q", "--detach", str(tmp_path / "wt"), "HEAD")
    mine = compile_cache.cache_dir("auto", repo)
    assert mine == compile_cache.cache_dir("auto", tmp_path / "wt")
    assert mine != compile_cache.cache_dir("auto", other)
    assert mine.parent == tmp_path / "xdg" / "moe_perf" / "compile"
    assert mine.name.startswith("repo-")
    assert compile_cache.cache_dir("off", repo) is None


# A custom autograd.Function whose backward an arm changes; the trainer's dispatch.py and
# balance.py Functions are of this kind (identity-like forward, a backward of their own).
CUSTOM_FUNCTION = """
import torch


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, grad):
        return grad * FACTOR


def loss(x):
    return Scale.apply(x.sin()).sum()
"""


def _compiled_grad(tmp_path: Path, name: str, factor: float):
    """Compile and run `loss` of a module written in its own directory (one arm's code), dynamo
    reset before and after; checks the gradient, returns this compile's AOTAutograd cache counters
    (hit, miss, saved, bypass)."""
    import importlib.util

    import torch
    from torch._dynamo.utils import counters

    src = tmp_path / name / "custom_function.py"
    src.parent.mkdir()
    src.write_text(CUSTOM_FUNCTION.replace("FACTOR", repr(factor)))
    spec = importlib.util.spec_from_file_location("custom_function", src)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch._dynamo.reset()
    counters.clear()
    x = torch.linspace(-1.0, 1.0, 16, requires_grad=True)
    torch.compile(module.loss)(x).backward()
    aot = {k.removeprefix("autograd_cache_"): v for k, v in counters["aot_autograd"].items()
           if k.startswith("autograd_cache_")}  # fmt: skip
    torch._dynamo.reset()
    torch.testing.assert_close(x.grad, torch.cos(x.detach()) * factor)  # this arm's backward ran
    return aot


@pytest.mark.slow
def test_a_graph_with_a_custom_autograd_function_is_cached_and_misses_when_its_backward_changes(
    tmp_path, monkeypatch
):
    from torch._functorch import config

    from moe_perf.trainer import runtime

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    monkeypatch.setattr(config, "autograd_cache_allow_custom_autograd_functions", False)
    # torch's default: such a graph bypasses AOTAutograd's cache (retraced by every arm)
    assert _compiled_grad(tmp_path, "default", 3.0).get("bypass", 0) > 0

    runtime.cache_custom_autograd_functions()  # what a compiled reference arm does
    assert config.autograd_cache_allow_custom_autograd_functions
    first = _compiled_grad(tmp_path, "base", 3.0)
    assert first.get("bypass", 0) == 0 and first["miss"] > 0 and first["saved"] > 0
    same = _compiled_grad(tmp_path, "feat-same-code", 3.0)  # another worktree, same code
    assert same["hit"] > 0 and same.get("miss", 0) == 0
    changed = _compiled_grad(tmp_path, "feat-backward-changed", 5.0)  # gradient checked: 5x
    assert changed["miss"] > 0 and changed.get("hit", 0) == 0


@pytest.mark.slow
def test_bytecode_is_cached_for_the_arms_where_the_environment_forbids_it_beside_sources(
    tmp_path,
):
    """PYTHONDONTWRITEBYTECODE=1 in the runner's environment: the arms compile each imported
    module once into the machine's moe_perf cache (PYTHONPYCACHEPREFIX), torch's too, and each
    worktree's own bytecode goes with its worktree. Another repository, with torch.compile
    caches of its own, reads torch's bytecode from there."""
    xdg = {"PYTHONDONTWRITEBYTECODE": "1", "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    run = ["dtype=fp32", "model.num_layers=1", "training.sequence_length=32",
           "training.global_batch=2", "training.max_steps=2", "wandb.mode=disabled",
           "compare.max_pairs=1"]  # fmt: skip
    repo = copy_of_moe_perf(tmp_path / "repo")
    result = moe_perf(tmp_path, f"repo={repo}", f"compile_cache={tmp_path / 'cache'}", *run,
                      "-m", "arm=base,feat", env=xdg)  # fmt: skip
    assert_ok(result)
    pycache = tmp_path / "xdg" / "moe_perf" / "pycache"
    torch_init = list(pycache.rglob("torch/__init__.*.pyc"))
    assert len(torch_init) == 1, "torch's bytecode cached once, for both arms"
    # the arms' worktrees (their trainer's modules) left nothing behind
    assert not [p for p in pycache.rglob("*.pyc") if "/moe_perf-" in str(p)]
    assert not [p for p in pycache.rglob("trainer") if p.is_dir() and "moe_perf-" in str(p)]
    assert not list((tmp_path / "cache").rglob("*.pyc"))

    written = torch_init[0].stat().st_mtime_ns
    other = copy_of_moe_perf(tmp_path / "other")
    result = moe_perf(tmp_path, f"repo={other}", f"compile_cache={tmp_path / 'cache2'}", *run,
                      "arm=base", env=xdg)  # fmt: skip
    assert_ok(result)
    assert torch_init[0].stat().st_mtime_ns == written, "torch's bytecode compiled again"


def test_bytecode_env_respects_the_users_own_choices(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    env = compile_cache.bytecode_env()
    pycache = tmp_path / "moe_perf" / "pycache"
    assert env == {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": str(pycache)}
    wt = tmp_path / "wt"
    assert compile_cache.bytecode_dir_of(env, wt) == pycache / str(wt)[1:]
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path / "mine"))  # their prefix: theirs
    assert compile_cache.bytecode_env() == {}
    assert compile_cache.bytecode_dir_of({"PYTHONPYCACHEPREFIX": "/x"}, wt) is None
    monkeypatch.delenv("PYTHONPYCACHEPREFIX")
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE")
    assert compile_cache.bytecode_env() == {}


def test_the_runner_keeps_its_own_bytecode_where_the_arms_keep_theirs(tmp_path):
    """Under PYTHONDONTWRITEBYTECODE=1 the runner's own modules (moe_perf's, Hydra's) and the
    comparison's are compiled once into the machine's bytecode directory and read from there by
    the next command; where the user names a prefix of their own, nothing goes there."""
    repo = make_repo(tmp_path / "repo")
    xdg = tmp_path / "xdg"
    env = {"PYTHONDONTWRITEBYTECODE": "1", "XDG_CACHE_HOME": str(xdg)}
    tag = sys.implementation.cache_tag
    own = xdg / "moe_perf" / "pycache" / ROOT.relative_to("/") / "moe_perf"
    dry = ["wandb.mode=disabled", "dry_run=true", "-m", "arm=base,feat"]

    assert_ok(moe_perf(repo, *dry, env=env))
    app = own / "runner" / f"app.{tag}.pyc"
    hydra = [p for p in (xdg / "moe_perf" / "pycache").rglob(f"hydra/__init__.{tag}.pyc")]
    assert app.is_file() and len(hydra) == 1
    written = {p: p.stat().st_mtime_ns for p in (app, hydra[0])}
    assert_ok(moe_perf(repo, *dry, env=env))
    assert {p: p.stat().st_mtime_ns for p in written} == written, "compiled again"

    compare = subprocess.run([sys.executable, "-m", "moe_perf.compare", "--help"], cwd=repo,
                             env={**os.environ, **env}, capture_output=True, text=True)  # fmt: skip
    assert compare.returncode == 0, compare.stderr
    assert (own / "report" / f"cli.{tag}.pyc").is_file()

    other = tmp_path / "xdg-other"  # their own prefix: theirs (and, with the setting, unused)
    theirs = {**env, "PYTHONPYCACHEPREFIX": str(tmp_path / "mine"), "XDG_CACHE_HOME": str(other)}
    assert_ok(moe_perf(repo, *dry, env=theirs))
    assert not (other / "moe_perf" / "pycache").exists() and not (tmp_path / "mine").exists()


def _prefix_env(tmp_path: Path) -> dict[str, str]:
    return {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": str(tmp_path / "pycache")}


@pytest.mark.slow
def test_a_many_core_hosts_first_arm_compiles_the_packages_bytecode_beside_it(tmp_path):
    """bytecode_compiled on a host of 8 cores or more (jinja2 here, a package torch imports,
    for speed): the pool compiles every module of it into the prefix while the arm runs, where
    Python itself then finds them (importing them rewrites none); the marker keeps the next
    arm from starting a pool."""
    env = _prefix_env(tmp_path)
    pycache = tmp_path / "pycache"
    with compile_cache.bytecode_compiled(env, ("jinja2",), cores=8) as pool:
        assert pool is not None
    assert pool.returncode == 0
    pool_end = time.time_ns()
    (jinja_dir,) = compile_cache.package_dirs(("jinja2",))
    ours = pycache / jinja_dir[1:]  # Python's layout under a prefix: the source's absolute path
    compiled = sorted(ours.rglob("*.pyc"))
    assert len(compiled) == len(list(Path(jinja_dir).rglob("*.py")))
    subprocess.run([sys.executable, "-c", "import jinja2, jinja2.compiler, jinja2.sandbox"],
                   env={**os.environ, **env}, check=True)  # fmt: skip
    assert sorted(ours.rglob("*.pyc")) == compiled
    assert all(p.stat().st_mtime_ns <= pool_end for p in compiled), "Python compiled again"
    assert len(list(pycache.glob(".compiled-*"))) == 1
    with compile_cache.bytecode_compiled(env, ("jinja2",), cores=8) as again:
        assert again is None


def test_no_pool_on_a_small_host_nor_under_the_users_own_bytecode_settings(tmp_path):
    with compile_cache.bytecode_compiled(_prefix_env(tmp_path), ("jinja2",), cores=2) as pool:
        assert pool is None  # 2 cores: the pool would take longer than the arm's own compile
    users = {"PYTHONPYCACHEPREFIX": str(tmp_path / "theirs")}  # no PYTHONDONTWRITEBYTECODE
    with compile_cache.bytecode_compiled(users, ("jinja2",), cores=8) as pool:
        assert pool is None
    with compile_cache.bytecode_compiled({}, ("jinja2",), cores=8) as pool:
        assert pool is None
    assert not (tmp_path / "pycache").exists() and not (tmp_path / "theirs").exists()


def test_an_interrupted_arm_kills_the_pool_and_leaves_no_marker(tmp_path):
    env = _prefix_env(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        with compile_cache.bytecode_compiled(env, ("torch",), cores=8) as pool:
            raise KeyboardInterrupt
    assert pool.returncode == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.killpg(pool.pid, 0)  # its workers went with it
    assert not list((tmp_path / "pycache").glob(".compiled-*"))


def _switched_on(monkeypatch, tmp_path: Path, value: str = "start") -> Path:
    """The runner's environment: bytecode kept in the machine's prefix, the pool's start set."""
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(compile_cache.POOL_SWITCH, value)
    return tmp_path / "moe_perf" / "pycache"


@pytest.mark.slow
def test_the_pool_started_with_the_command_is_the_one_the_first_arm_waits_for(
    tmp_path, monkeypatch
):
    pycache = _switched_on(monkeypatch, tmp_path)
    early = compile_cache.start_bytecode_pool(("jinja2",), cores=8)
    assert early is not None
    assert compile_cache.start_bytecode_pool(("jinja2",), cores=8) is early  # once a process
    arm_env = compile_cache.bytecode_env()  # what the arm's environment adds
    with compile_cache.bytecode_compiled(arm_env, ("jinja2",), cores=8) as pool:
        assert pool is early  # no second pool
    assert early.returncode == 0
    (jinja_dir,) = compile_cache.package_dirs(("jinja2",))
    assert len(list((pycache / jinja_dir[1:]).rglob("*.pyc"))) == len(
        list(Path(jinja_dir).rglob("*.py")))  # fmt: skip
    assert len(list(pycache.glob(".compiled-*"))) == 1  # the next arm starts none
    assert compile_cache.start_bytecode_pool(("jinja2",), cores=8) is None


def test_the_pool_starts_early_only_where_the_arms_would_start_it_and_not_when_told_arm(
    tmp_path, monkeypatch
):
    _switched_on(monkeypatch, tmp_path, value="arm")
    assert compile_cache.start_bytecode_pool(("jinja2",), cores=8) is None  # with the arm
    monkeypatch.delenv(compile_cache.POOL_SWITCH)  # the default: with the command
    assert compile_cache.start_bytecode_pool(("jinja2",), cores=2) is None  # a small host
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path / "theirs"))  # their prefix: theirs
    assert compile_cache.start_bytecode_pool(("jinja2",), cores=8) is None
    assert not (tmp_path / "moe_perf").exists()


def test_a_bad_pool_setting_is_refused_before_anything_starts(tmp_path):
    repo = make_repo(tmp_path / "repo")
    result = moe_perf(repo, "wandb.mode=disabled", "-m", "arm=base,feat",
                      env={compile_cache.POOL_SWITCH: "early"})  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "MOE_PERF_BYTECODE_POOL='early'" in line and "`start`" in line and "`arm`" in line
    assert not (repo / "outputs").exists()


@pytest.mark.slow
def test_a_command_that_ends_before_its_pool_kills_it_and_leaves_no_marker(tmp_path):
    """A dry run, a refusal: the command exits while the pool it started early (by default)
    still compiles (torch's thousands of modules); the pool goes with it, its workers too."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "XDG_CACHE_HOME": str(tmp_path)}
    env.pop("PYTHONPYCACHEPREFIX", None)
    env.pop(compile_cache.POOL_SWITCH, None)
    done = subprocess.run(
        [sys.executable, "-c", "from moe_perf.runner import compile_cache\n"
         "pool = compile_cache.start_bytecode_pool(('torch',), cores=8)\n"
         "print(pool.pid, pool.poll() is None, flush=True)"],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    pid, running = done.stdout.split()
    assert running == "True"  # still compiling when the command ended
    with pytest.raises(ProcessLookupError):
        os.killpg(int(pid), 0)
    assert not list((tmp_path / "moe_perf" / "pycache").glob(".compiled-*"))
