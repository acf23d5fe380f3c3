"""torch.compile's own caches, shared by the arms and sweeps of one repository.

`compile_cache=auto` (the default) points inductor's cache (its FX-graph cache, the AOTAutograd
cache, compiled kernels) and Triton's kernel cache at
`$XDG_CACHE_HOME/moe_perf/compile/<repository>-<hash of its git directory>` (`~/.cache` when
XDG_CACHE_HOME is unset); a path picks another directory, `off` leaves torch's own defaults.

Nothing is reused wrongly because torch keys every entry by content: an FX-graph entry by the
graph's code, its inputs' shapes, dtypes, strides and devices, the inductor config, a hash of
torch's own source files (so another torch version misses), and, under a
`<system hash>` directory, the GPU's name and the CUDA and Triton versions; AOTAutograd's key
wraps the same details, and Triton keys a kernel by its source, the Triton version and the
target architecture. An arm whose model code changed therefore recompiles the graphs that
changed and loads the rest; dynamo still traces every arm (its bytecode is not cached). Where
the environment forbids Python's bytecode beside the sources, the arms keep it in one directory
of the machine, `$XDG_CACHE_HOME/moe_perf/pycache` (`bytecode_env`). The reference trainer also
lets AOTAutograd cache the graphs that hold its custom autograd Functions, which torch leaves
out by default (trainer/runtime.py, cache_custom_autograd_functions).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from moe_perf.common.errors import REFUSED
from moe_perf.runner import git

# Forced on, whatever the runner's environment says (both are on by default in torch >= 2.5).
CACHES_ON = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}


def moe_perf_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moe_perf"


def default_root() -> Path:
    return moe_perf_cache() / "compile"


def cache_dir(setting: Any, code: Path) -> Path | None:
    """The cache directory of the repository that `code` (a worktree of it) belongs to; None
    for `off`. Every worktree of a repository shares its git directory, so its arms share it."""
    value = str(setting if setting is not None else "auto")
    if value == "off":
        return None
    if value != "auto":
        return Path(value).expanduser().resolve()
    try:
        common = git.common_dir(code).resolve()
    except git.GitError:  # a plain directory (no git): keyed by its own path
        common = Path(code).resolve()
    name = common.parent.name if common.name == ".git" else common.name.removesuffix(".git")
    key = hashlib.sha256(str(common).encode()).hexdigest()[:12]
    return default_root() / f"{name or 'repo'}-{key}"


def cache_env(cfg: Any, code: Path) -> dict[str, str]:
    """What an arm's environment adds for `compile_cache` (empty for `off`)."""
    directory = cache_dir(cfg.get("compile_cache", "auto"), code)
    if directory is None:
        return {}
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(directory / "inductor"),
        "TRITON_CACHE_DIR": str(directory / "triton"),
        **CACHES_ON,
        **bytecode_env(),
    }


def under(cfg: Any, code: Path, env: dict[str, str]) -> dict[str, str]:
    """A trainer's environment: `cache_env` for the arm's worktree `code`, under the adapter's
    `env` (which holds the user's trainer.env): what the adapter or the user set wins."""
    return {**cache_env(cfg, code), **env}


# Python's own compile cache. Where PYTHONDONTWRITEBYTECODE is set (a common line in Dockerfiles;
# the CUDA image of the GPU benchmarks, torch 2.11.0+cu130, sets it and ships torch without .pyc
# files), every trainer process compiles the source of every module it imports: `import torch`
# and torch._dynamo took 7.4-8.3 s in each arm there (one H200). The arms then keep their
# bytecode in one directory of the machine instead (PYTHONPYCACHEPREFIX), never beside the
# sources, which is what that setting protects.
# It is not the repository's: Python checks each cached file against its source's path, size and
# modification time, so torch's bytecode serves every repository's arms (a new repository's first
# arm, whose torch.compile caches are cold, does not compile torch's source again). A worktree is
# a new directory every arm (git.worktree), so its files never meet another arm's bytecode, and
# `bytecode_dir_of` says where each worktree's went, for the runner to remove with the worktree.


def bytecode_env() -> dict[str, str]:
    """PYTHONPYCACHEPREFIX under this machine's moe_perf cache when the runner's environment
    forbids writing bytecode beside the sources and names no prefix of its own; empty otherwise."""
    if not os.environ.get("PYTHONDONTWRITEBYTECODE") or os.environ.get("PYTHONPYCACHEPREFIX"):
        return {}
    # an empty PYTHONDONTWRITEBYTECODE is unset for Python
    return {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": str(moe_perf_cache() / "pycache")}


def keep_runner_bytecode() -> None:
    """The runner's own bytecode kept where the arms keep theirs (bytecode_env), for the rest of
    this process. Under the same setting the runner compiles every module it imports too: in a
    sweep about 1,300 (Hydra, numpy, moe_perf; scipy and matplotlib for the comparison), which
    took about 1.9 s of a sweep on a 2-core VM where the packages came without bytecode
    (docs/benchmarks/runner-bytecode-cpu-2026-12.md). Only this process: its
    environment, which every launch inherits, is left as it is. Modules imported before this
    call are compiled as before."""
    env = bytecode_env()
    if env:
        sys.pycache_prefix = env["PYTHONPYCACHEPREFIX"]
        sys.dont_write_bytecode = False


# The installed packages a trainer imports by the thousand modules: torch, what torch imports
# (sympy, networkx, mpmath, numpy, jinja2) and Triton (to compile). The same modules bytecode_env
# makes every fresh machine's first arm compile, one after the other, before its first line runs:
# about 2,500 of them, 5 s on an H100 VM's 16-core host and 7 s on a 2-core VM.
BYTECODE_PACKAGES = ("torch", "sympy", "networkx", "mpmath", "numpy", "jinja2", "triton")
# Compiling all of them takes 14 s of CPU: 9.3 s of wall on 2 cores, longer than the trainer's
# own serial compile of the modules it needs; about 1.5 s on 16.
BYTECODE_POOL_MIN_CORES = 8


def package_dirs(names=BYTECODE_PACKAGES) -> list[str]:
    """The installed directories of the packages `names` (those installed), found without
    importing them."""
    found = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            found.append(str(Path(list(spec.submodule_search_locations)[0]).resolve()))
    return found


# MOE_PERF_BYTECODE_POOL: when the pool starts. `start` (the default): when the command does,
# before Hydra composes anything, so it has the runner's own start-up (its imports, the
# composition, the pre-flight, the worktree) to compile ahead of the trainer's imports; `arm`:
# with the arm, beside the trainer. Decided from the environment because it comes before any
# config. On one H100, the machine's first arm with a carried compile cache and an empty bytecode
# directory (page cache dropped), in four pairs, two in the order arm, start and two in ABBA
# order: 0.4-1.2 s less of arm and 0.2-1.5 s less of command with `start` in all four
# (docs/benchmarks/first-arm-h100-2026-12.md).
POOL_SWITCH = "MOE_PERF_BYTECODE_POOL"
POOL_STARTS = ("start", "arm")  # the first is the default
_POOLS: dict[Path, subprocess.Popen] = {}  # this process's pools, by marker, until an arm ends


def _pool_plan(env: dict[str, str], packages, cores: int | None) -> tuple[list[str], Path] | None:
    """(package directories, marker) where `env` keeps bytecode in the machine's prefix, the
    host has BYTECODE_POOL_MIN_CORES and the pool has not finished there yet; else None."""
    prefix = env.get("PYTHONPYCACHEPREFIX")
    cores = (os.cpu_count() or 1) if cores is None else cores
    if not prefix or "PYTHONDONTWRITEBYTECODE" not in env or cores < BYTECODE_POOL_MIN_CORES:
        return None  # before the packages are looked up: every command on a small host asks
    dirs = package_dirs(packages)
    key = hashlib.sha256(json.dumps([sys.version, [(d, os.stat(d).st_mtime_ns) for d in dirs]])
                         .encode()).hexdigest()[:16]  # fmt: skip
    marker = Path(prefix) / f".compiled-{key}"
    if not dirs or marker.exists():
        return None
    return dirs, marker


def _start_pool(env: dict[str, str], dirs: list[str], marker: Path) -> subprocess.Popen:
    """The pool, its marker written as soon as it has finished (by a thread: another command
    of the machine, e.g. a bisection's sweep, then finds it at once)."""
    # quiet: a package's files for another Python version fail to compile (never imported)
    pool = subprocess.Popen(
        [sys.executable, "-m", "compileall", "-q", "-j", "0", *dirs],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    _POOLS[marker] = pool
    threading.Thread(target=_mark_when_done, args=(pool, marker), daemon=True).start()
    return pool


def _mark_when_done(pool: subprocess.Popen, marker: Path) -> None:
    if pool.wait() >= 0:  # finished; not killed
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()


def _end_pool(marker: Path, pool: subprocess.Popen) -> None:
    """A finished pool's marker written (now, not when its thread gets to it); an unfinished one
    killed (its own session: its workers go with it; what it wrote stays, and compileall skips
    it next time)."""
    _POOLS.pop(marker, None)
    if pool.poll() is None:
        os.killpg(pool.pid, signal.SIGKILL)
        pool.wait()
    _mark_when_done(pool, marker)


def _end_pools_at_exit() -> None:
    for marker, pool in list(_POOLS.items()):
        _end_pool(marker, pool)


def start_bytecode_pool(packages=BYTECODE_PACKAGES, cores: int | None = None,
                        ) -> subprocess.Popen | None:  # fmt: skip
    """The pool `bytecode_compiled` would start with the machine's first arm, started now (unless
    MOE_PERF_BYTECODE_POOL=arm), for the bytecode directory of the runner's environment
    (bytecode_env), under the same conditions. The arm that follows waits for it as for its own;
    a command that ends first (a dry run, a refusal, compile_cache=off) kills it if unfinished.
    Once per process; None where it does not start. Any other value of the variable ends the
    command, before anything starts, with a line that says the values it takes."""
    when = os.environ.get(POOL_SWITCH) or POOL_STARTS[0]
    if when not in POOL_STARTS:
        print(f"[moe_perf] cannot run: {POOL_SWITCH}={when!r}: set it to `start` (the default: "
              f"the bytecode pool starts with the command) or `arm` (with the machine's first "
              f"arm)", file=sys.stderr, flush=True)  # fmt: skip
        raise SystemExit(REFUSED)
    if when == "arm":
        return None
    env = bytecode_env()
    plan = _pool_plan(env, packages, cores)
    if plan is None:
        return None
    dirs, marker = plan
    if marker in _POOLS:
        return _POOLS[marker]
    atexit.register(_end_pools_at_exit)
    return _start_pool(env, dirs, marker)


@contextlib.contextmanager
def bytecode_compiled(env: dict[str, str], packages=BYTECODE_PACKAGES,
                      cores: int | None = None):  # fmt: skip
    """While an arm runs: where its environment keeps bytecode in the machine's prefix
    (bytecode_env) and these packages' bytecode is not there yet, compile it there with every
    core (`python -m compileall -j 0`), beside the trainer, which then finds most of the
    modules it imports compiled instead of compiling them one by one; or, where the command
    started that pool already (start_bytecode_pool), that one. Once per prefix, Python and set
    of installed package versions: a marker file, written when the pool has finished, keeps
    later arms from starting it; hosts of fewer than BYTECODE_POOL_MIN_CORES cores never start
    it. The arm's end waits for the pool (done by then on such a host); an interrupted arm
    kills it (what it wrote stays, and compileall skips it next time)."""
    plan = _pool_plan(env, packages, cores)
    if plan is None:
        yield None
        return
    dirs, marker = plan
    pool = _POOLS.get(marker) or _start_pool(env, dirs, marker)
    try:
        yield pool
        pool.wait()
    finally:
        _end_pool(marker, pool)


def bytecode_dir_of(env: dict[str, str], directory: Path) -> Path | None:
    """Where the bytecode of the modules under `directory` went under `env`'s prefix, if any."""
    prefix = env.get("PYTHONPYCACHEPREFIX")
    if not prefix or "PYTHONDONTWRITEBYTECODE" not in env:  # the user's own prefix: theirs
        return None
    return Path(prefix) / Path(directory).resolve().relative_to("/")


def describe(record_cache: dict | None) -> str:
    """`compile cache DIR: FX graphs 13 hit / 0 missed, AOT autograd 5 hit / 0 missed`."""
    if not record_cache or not record_cache.get("dir"):
        return "compile cache: torch's default"
    counts = record_cache.get("counters") or {}
    parts = []
    kinds = (("FX graphs", "fxgraph_cache"), ("AOT autograd", "autograd_cache"))
    for what, key in kinds:
        hit, miss = f"{key}_hit", f"{key}_miss"
        if hit in counts or miss in counts:
            parts.append(f"{what} {counts.get(hit, 0)} hit / {counts.get(miss, 0)} missed")
    return f"compile cache {record_cache['dir']}" + (": " + ", ".join(parts) if parts else "")


def read_startup(arm_dir: Path) -> dict | None:
    """The trainer's `startup.json` (rank 0's start-up timeline and compile counters), if any."""
    try:
        return json.loads((arm_dir / "startup.json").read_text())
    except (OSError, ValueError):
        return None
