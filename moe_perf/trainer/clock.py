"""The process's clock and the start-up helpers' thread record. Torch-free, so the trainer's
entry point (__main__, early.py) can use them before torch is imported."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

_IMPORTED = time.perf_counter()


def process_age_s() -> float:
    """Seconds since this process started (Linux: /proc/self/stat against the boot clock), so
    the interpreter's start-up and every import count; elsewhere, since this module's import."""
    try:
        fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start, in clock ticks
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started
        if 0 <= age < 86400 * 365:  # another clock in a container's time namespace: fall back
            return age
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    return time.perf_counter() - _IMPORTED


@dataclass
class HelperThread:
    """A start-up helper's thread and what it did, for startup.json: its seconds, how long the
    build's join waited for it, and the error it met if any (a helper only: the build or step 1
    makes the same calls and reports them)."""

    thread: threading.Thread
    seconds: float | None = None
    waited_s: float | None = None
    error: str | None = None

    def join(self) -> None:
        t0 = time.perf_counter()
        self.thread.join()
        self.waited_s = round(time.perf_counter() - t0, 3)

    def summary(self) -> dict:
        return {"seconds": self.seconds, "waited_s": self.waited_s, "error": self.error}
