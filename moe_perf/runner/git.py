"""Git for the runner: refs to SHAs, the clean-tree check, worktrees, the sweep lock.

Plain `git` subprocesses with argument lists: each call is explicit, nothing is cached, and no
long-lived library object holds file handles across a sweep (a known GitPython leak).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


class GitError(RuntimeError):
    """A git command failed; the message carries git's own words."""


class LockBusy(RuntimeError):
    """Another sweep holds the repository's lock."""


def git(repo: str | Path, *args: str, strip: bool = True) -> str:
    proc = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise GitError(f"git {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip() if strip else proc.stdout


def toplevel(path: str | Path) -> Path:
    """The root of the work tree that contains `path` (GitError when there is none)."""
    return Path(git(path, "rev-parse", "--show-toplevel"))


def common_dir(repo: str | Path) -> Path:
    """The repository's shared .git directory (the same from every worktree)."""
    return Path(git(repo, "rev-parse", "--path-format=absolute", "--git-common-dir"))


def current_branch(repo: str | Path) -> str | None:
    """The branch checked out in `repo`, its commit SHA if HEAD is detached, None if no repo."""
    try:
        return git(repo, "symbolic-ref", "--quiet", "--short", "HEAD")
    except GitError:
        pass
    try:
        return git(repo, "rev-parse", "--verify", "--quiet", "HEAD^{commit}")
    except GitError:
        return None


def resolve_ref(repo: str | Path, ref: str) -> str | None:
    """The commit SHA of `ref`: a branch first, then a tag, then anything git can name.

    Branches win over tags of the same name (git's own order puts the tag first).
    """
    for candidate in (f"refs/heads/{ref}", f"refs/tags/{ref}", ref):
        try:
            return git(repo, "rev-parse", "--verify", "--quiet", f"{candidate}^{{commit}}")
        except GitError:
            continue
    return None


def dirty_files(repo: str | Path) -> list[str]:
    """Modified, staged and untracked paths (ignored files do not count)."""
    # not stripped: the status columns start with a space (" M file")
    out = git(repo, "status", "--porcelain=v1", "--untracked-files=all", strip=False)
    return [line[3:] for line in out.splitlines() if line.strip()]


def is_ignored(repo: str | Path, path: str | Path) -> bool:
    proc = subprocess.run(
        ["git", "-C", str(repo), "check-ignore", "--quiet", "--no-index", str(path)],
        capture_output=True,
        check=False,
    )
    return proc.returncode == 0


# A worktree of the runner is `<tmp>/moe_perf-<label>-<random>/worktree`: how a stale one is known.
WORKTREE_PREFIX = "moe_perf-"


def add_worktree(repo: str | Path, sha: str, label: str) -> Path:
    """A detached worktree of `repo` at `sha` in a new temp directory outside the repository;
    the caller removes it (`discard_worktree`)."""
    parent = Path(tempfile.mkdtemp(prefix=f"{WORKTREE_PREFIX}{label}-"))
    path = parent / "worktree"
    try:
        git(repo, "worktree", "add", "--detach", "--quiet", str(path), sha)
    except BaseException:
        shutil.rmtree(parent, ignore_errors=True)
        raise
    return path


@contextlib.contextmanager
def worktree(repo: str | Path, sha: str, label: str) -> Iterator[Path]:
    """`add_worktree` for the body only: removed on the way out, also when the body raises
    (timeout, Ctrl-C)."""
    path = add_worktree(repo, sha, label)
    try:
        yield path
    finally:
        discard_worktree(repo, path)


def remove_worktree(repo: str | Path, path: Path) -> None:
    with contextlib.suppress(GitError):
        git(repo, "worktree", "remove", "--force", str(path))
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(GitError):
        git(repo, "worktree", "prune")


def discard_worktree(repo: str | Path, path: Path) -> None:
    """A worktree of `add_worktree` gone, with its temp directory."""
    remove_worktree(repo, path)
    shutil.rmtree(path.parent, ignore_errors=True)


def worktree_paths(repo: str | Path) -> list[Path]:
    """Every worktree git knows of, the main one first."""
    out = git(repo, "worktree", "list", "--porcelain")
    prefix = "worktree "
    return [Path(line[len(prefix) :]) for line in out.splitlines() if line.startswith(prefix)]


def moe_perf_worktrees(repo: str | Path) -> list[Path]:
    """The runner's worktrees of `repo` that git knows of (after pruning those whose directory is
    gone). With the sweep lock held, every one of them is a leftover of a dead runner."""
    with contextlib.suppress(GitError):
        git(repo, "worktree", "prune")
    return [
        path for path in worktree_paths(repo)[1:]
        if path.name == "worktree" and path.parent.name.startswith(WORKTREE_PREFIX)
    ]  # fmt: skip


class SweepLock:
    """An exclusive lock on one repository, held by one sweep (one process) until it exits.

    fcntl locks die with their process, so a crashed or killed sweep never leaves a stale lock.
    The file records who holds it, for the message the second sweep prints.
    """

    def __init__(self, repo: str | Path):
        self.path = common_dir(repo) / "moe_perf.lock"
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, holder: dict) -> None:
        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = _read_holder(fd)
            os.close(fd)
            raise LockBusy(
                f"another moe_perf sweep is running on this repository ({other}); arms must run "
                f"one after another: wait for it to finish (lock file {self.path})"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({**holder, "pid": os.getpid(), "since": time.time()}).encode())
        self._fd = fd

    def try_lock(self) -> None:
        """LockBusy when another sweep holds the lock; takes nothing."""
        self.acquire({"sweep_id": None, "probe": True})
        self.release()

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return "holder unknown"
    started = time.strftime("%H:%M:%S", time.localtime(info.get("since", 0)))
    return f"pid {info.get('pid')}, sweep {info.get('sweep_id')}, since {started}"


def path_in_commit(repo: str | Path, sha: str, path: str) -> bool:
    """Whether `path` (file or directory) exists in commit `sha`."""
    try:
        git(repo, "cat-file", "-e", f"{sha}:{path.strip('/')}")
        return True
    except GitError:
        return False
