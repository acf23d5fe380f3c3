"""The peak resident memory of this process alone: the contract's `peak_mem_gib` on a CPU.

`getrusage(RUSAGE_SELF).ru_maxrss` is not that on Linux: the kernel carries the largest RSS
across fork and exec, so a trainer started by a runner holding 300 MB reports at least 300 MB
whatever it uses itself (a child measured 311 MiB by ru_maxrss, 10.9 MB by its own VmHWM).
`VmHWM` in /proc/self/status is the high-water mark of this process's own address space, which
exec replaces. Pure Python: the runner, the reference trainer and any Python trainer import it.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

GIB = 2**30


def _vm_hwm_bytes(status: Path = Path("/proc/self/status")) -> int | None:
    """VmHWM (kB in the file, KiB in fact) of /proc/self/status, or None where there is none."""
    try:
        lines = status.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident memory: VmHWM on Linux; elsewhere ru_maxrss (bytes on
    macOS, KiB on the BSDs), where no /proc says it otherwise."""
    own = _vm_hwm_bytes()
    if own is not None:
        return own
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def peak_rss_gib() -> float:
    return peak_rss_bytes() / GIB
