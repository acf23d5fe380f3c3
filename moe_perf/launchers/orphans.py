"""Leftovers of a sweep whose runner died (SIGKILL, the OOM killer, a closed terminal): the
launch's processes, re-parented to init and still holding the devices, and its worktrees.

Every process of a launch carries `MOE_PERF_LAUNCH=<token>` and `MOE_PERF_REPO=<repository>` in
its environment (process.py), so they are found after their runner is gone. A sweep holding
the repository's lock is the only live sweep on it: every launch of that repository that is
still running then belongs to a dead runner, and is stopped before anything is measured.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import time
from pathlib import Path

LAUNCH_TOKEN_ENV = "MOE_PERF_LAUNCH"
LAUNCH_REPO_ENV = "MOE_PERF_REPO"


def _environ(pid: str) -> dict[bytes, bytes]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}  # gone, or another user's
    pairs = (item.partition(b"=") for item in raw.split(b"\0") if item)
    return {key: value for key, _, value in pairs}


def launches(repo: str | Path) -> dict[str, set[int]]:
    """{launch token: pids} of every moe_perf launch from `repo` that is running (Linux /proc)."""
    repo_bytes = str(Path(repo).resolve()).encode()
    found: dict[str, set[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        env = _environ(entry.name)
        token = env.get(LAUNCH_TOKEN_ENV.encode())
        if token and env.get(LAUNCH_REPO_ENV.encode()) == repo_bytes:
            found.setdefault(token.decode(), set()).add(int(entry.name))
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":  # a zombie holds nothing; its parent (init) reaps it
            alive.add(pid)
    return alive


def stop_pids(pids: set[int], grace_s: float) -> set[int]:
    """SIGTERM, SIGKILL after `grace_s`; the pids still alive after that (not ours to kill)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in _alive(pids):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while _alive(pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _alive(pids):
            return set()
    return _alive(pids)


def describe_pids(pids: set[int]) -> str:
    """`4242 (python -m torch.distributed.run ...), ...` for a message."""
    shown = []
    for pid in sorted(pids):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            cmd = "?"
        shown.append(f"{pid} ({cmd[:80]}{'...' if len(cmd) > 80 else ''})")
    return ", ".join(shown)


def owners_and_states(pids: set[int]) -> str:
    """`4242: user alice, state D` for each pid: why a signal may not have stopped it."""
    shown = []
    for pid in sorted(pids):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            uid = int(Path(f"/proc/{pid}/status").read_text().split("\nUid:")[1].split()[0])
        except (OSError, IndexError, ValueError):
            shown.append(f"{pid}: gone")
            continue
        try:
            user = pwd.getpwuid(uid).pw_name
        except KeyError:
            user = f"uid {uid}"
        shown.append(f"{pid}: user {user}, state {state}")
    return ", ".join(shown)
