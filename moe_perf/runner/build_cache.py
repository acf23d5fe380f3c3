"""`trainer.build_cache`: a commit's build kept across sweeps, reused when nothing it depends on
has changed.

Within a sweep a commit is built once (its worktree lives for the whole sweep). Across sweeps,
with `trainer.build_cache=auto` (`$XDG_CACHE_HOME/moe_perf/build`, `~/.cache` when unset) or a
directory, what a successful build left in the worktree (the files `git status` lists as new,
ignored or modified afterwards: the built extension, its build directory, a `--target` prefix)
is stored under a key, and a later sweep that computes the same key copies those files into
its fresh worktree instead of building. The key is a hash of:

* the commit (its SHA: the sources);
* the build command as configured (before its placeholders are filled: the worktree's own path
  differs every sweep);
* the toolchain as the build would see it: the interpreter (path and version), torch (version,
  CUDA version, git revision, read from its files without importing it), `nvcc --version`,
  the C and C++ compilers' `--version`, the GPUs' compute capabilities, the variables that
  steer a build (CC, CXX, *FLAGS, CUDA_HOME, TORCH_CUDA_ARCH_LIST, ...) and the trainer's env.

What the key does not see is not reused safely: a build that reads files outside the worktree
(a library of the system updated in place) or writes outside it. `off` (the default) never
stores nor reuses. Entries are never evicted: remove the directory to reclaim its space.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from moe_perf.common.armcode import gpu_compute_capabilities
from moe_perf.runner import git
from moe_perf.runner.compile_cache import moe_perf_cache

# Variables that change what a C++/CUDA build produces (the trainer's env is keyed whole).
BUILD_VARIABLES = ("CC", "CXX", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "CUDA_HOME",
                   "CUDA_PATH", "TORCH_CUDA_ARCH_LIST", "NVCC_FLAGS", "NVCC_APPEND_FLAGS",
                   "NVCC_PREPEND_FLAGS", "CUDAARCHS")  # fmt: skip

# torch's version file, read by the arms' interpreter without importing torch (seconds saved)
_TORCH_VERSION = r"""
import importlib.util, pathlib
spec = importlib.util.find_spec("torch")
path = spec and spec.submodule_search_locations and pathlib.Path(
    list(spec.submodule_search_locations)[0], "version.py")
print(path.read_text() if path and path.is_file() else "no torch")
"""
ENTRY = "entry.json"  # written last into an entry: an entry without it is not one


def cache_root(setting: Any) -> Path | None:
    """The cache directory `trainer.build_cache` names; None for `off`."""
    value = str(setting if setting is not None else "off")
    if value in ("off", "False", "false"):  # YAML reads an unquoted off as false
        return None
    if value == "auto":
        return moe_perf_cache() / "build"
    return Path(value).expanduser().resolve()


def _output(argv: list[str], env: dict[str, str]) -> str:
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60,
                              check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "absent"
    return (proc.stdout + proc.stderr).strip() if proc.returncode == 0 else "absent"


def toolchain(env: dict[str, str], python: str = sys.executable) -> dict:
    """What the build would be built with, as the build's environment `env` finds it."""
    cuda_home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    nvcc = str(Path(cuda_home, "bin", "nvcc")) if cuda_home else "nvcc"
    return {
        "python": [python, _output([python, "-c", "import sys; print(sys.version)"], env)],
        "torch": _output([python, "-c", _TORCH_VERSION], env),
        "nvcc": _output([nvcc, "--version"], env).splitlines()[-1:],
        "cc": _output([env.get("CC", "cc"), "--version"], env).splitlines()[:1],
        "cxx": _output([env.get("CXX", "c++"), "--version"], env).splitlines()[:1],
        "gpus": gpu_compute_capabilities(),
        "variables": {name: env[name] for name in BUILD_VARIABLES if env.get(name)},
    }


def build_key(sha: str, build: list[str], trainer_env: dict[str, str], tools: dict) -> str:
    """The cache key of a commit's build (module docstring)."""
    keyed = {"sha": sha, "build": [str(part) for part in build],
             "trainer_env": dict(sorted(trainer_env.items())), "toolchain": tools}  # fmt: skip
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:32]


def produced_files(worktree: Path) -> tuple[list[str], list[str]]:
    """(files the build made or changed, tracked files it deleted), relative to the worktree."""
    out = git.git(worktree, "status", "--porcelain=v1", "-z", "--untracked-files=all",
                  "--ignored", strip=False)  # fmt: skip
    made, deleted = [], []
    for entry in filter(None, out.split("\0")):
        state, path = entry[:2], entry[3:]
        (deleted if "D" in state else made).append(path)
    return sorted(made), sorted(deleted)


def store(root: Path, key: str, worktree: Path, about: dict) -> Path | None:
    """The build's files copied into the cache as entry `key` (None when one is there
    already). Written into a temporary directory and renamed: a reader never sees half."""
    final = root / key
    if (final / ENTRY).is_file():
        return None
    made, deleted = produced_files(worktree)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
    try:
        for relative in made:
            target = staging / "files" / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(worktree / relative, target, follow_symlinks=False)
        entry = {**about, "files": made, "deleted": deleted}
        (staging / ENTRY).write_text(json.dumps(entry, indent=2) + "\n")
        os.rename(staging, final)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if (final / ENTRY).is_file():  # another sweep stored it first
            return None
        raise
    return final


def restore(root: Path, key: str, worktree: Path) -> dict | None:
    """Entry `key` copied into `worktree` (its `entry.json`), or None when there is none."""
    entry_dir = root / key
    try:
        entry = json.loads((entry_dir / ENTRY).read_text())
    except (OSError, ValueError):
        return None
    for relative in entry["files"]:
        target = worktree / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            target.unlink()
        shutil.copy2(entry_dir / "files" / relative, target, follow_symlinks=False)
    for relative in entry.get("deleted", []):
        (worktree / relative).unlink(missing_ok=True)
    return entry
