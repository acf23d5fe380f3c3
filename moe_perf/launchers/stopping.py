"""Stopping a launch: every process it started, found by the token in its environment, SIGTERM
first and SIGKILL after a grace period; a second Ctrl-C meanwhile means "kill it now". The same
for every launcher (launchers/process.py runs the launch).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from moe_perf.launchers.orphans import LAUNCH_TOKEN_ENV


def _processes_with_token(token: str) -> set[int]:
    """Pids whose environment carries this launch's token (Linux /proc)."""
    needle = f"{LAUNCH_TOKEN_ENV}={token}".encode()
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.add(int(entry.name))
        except OSError:
            continue  # gone, or not ours
    return pids


def _signal_all(proc: subprocess.Popen, pids: set[int], sig: int) -> None:
    if proc.poll() is None:  # never signal a group id that a finished torchrun has released
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)  # torchrun's own group (start_new_session)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


class _Escalation:
    """While an interrupted arm is being stopped, a second Ctrl-C (or SIGTERM) means "kill it
    now", never "leave it running": the signal sets a flag instead of raising."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> _Escalation:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._request)
        return self

    def _request(self, signum, frame) -> None:
        self.requested = True

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _launch_gone(proc: subprocess.Popen, token: str) -> bool:
    return proc.poll() is not None and not _processes_with_token(token)


def stop_launch(proc: subprocess.Popen, token: str, grace_s: float,
                notify: Callable[[str], None] | None = None) -> bool:  # fmt: skip
    """SIGTERM to torchrun's group and every process of this launch, SIGKILL after `grace_s`
    or at a Ctrl-C meanwhile; returns only when no process of the launch is left, True when
    a Ctrl-C (or SIGTERM) came while it waited (the caller decides what that stops).

    torchrun forwards SIGTERM to its workers; whatever is still there after the grace period
    (a hung collective, a trainer that ignores SIGTERM) is killed. `notify` is told what
    happens while it takes long (an interrupted sweep's console).
    """
    pids = _processes_with_token(token)
    if proc.poll() is not None and not pids:
        return False
    with _Escalation() as escalation:
        _signal_all(proc, pids, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not escalation.requested:
            if _launch_gone(proc, token):
                return False
            time.sleep(0.1)
        if not _launch_gone(proc, token):
            if notify:
                why = f"still up after {grace_s:g} s"
                why = "interrupted again" if escalation.requested else why
                notify(f"{why}: SIGKILL sent to the arm's processes; waiting until they are gone")
            _kill(proc, token, notify)
    return escalation.requested


def _kill(proc: subprocess.Popen, token: str, notify: Callable[[str], None] | None) -> None:
    """SIGKILL until no process of the launch is left. SIGKILLed workers are re-parented to
    init and reaped there; one in an uninterruptible wait (a driver call) dies when that
    returns: wait for it, and say so every 10 s."""
    waited = 0.0
    while not _launch_gone(proc, token):
        _signal_all(proc, _processes_with_token(token), signal.SIGKILL)
        time.sleep(0.2)
        waited += 0.2
        if notify and waited >= 10 and waited % 10 < 0.2:
            left = " ".join(map(str, sorted(_processes_with_token(token))))
            notify(f"still waiting for pid(s) {left or proc.pid} to exit after SIGKILL")
