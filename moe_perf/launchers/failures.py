"""Why a launch failed, read from its console output: the trainer's own exit code as torchrun
reports it (or as the trainer exited, when it ran alone without torchrun), and the one line
that says what went wrong (out of memory with the allocation, an NCCL error or timeout, the
last exception).

torchrun exits 1 whenever a worker fails; its error summary names the root cause::

    Root Cause (first observed failure):
    [0]:
      rank      : 0 (local_rank: 0)
      exitcode  : 3 (pid: 2064)                 (-9 ... (SIGKILL) for a signal)

Workers' lines carry torchrun's `[rank0]:` prefix (the global rank, as trainer_env asks; by
default `[default0]:`, the local one); torchrun's own traceback has none, so the worker's
exception is told apart from torchrun's ChildFailedError.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

_ROOT_CAUSE_RE = re.compile(
    r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)"
    r"[^\n]*?(\((SIG\w+)\))?\s*$",
    re.DOTALL | re.MULTILINE,
)
_WORKER_RE = re.compile(r"^\s*(?:\d+:\s)?\[(?:default|rank)(\d+)\]:(.*)$")
# torch.distributed prefixes each line of a worker's uncaught exception with `[rank0]: `, inside
# torchrun's own prefix: `[default0]:[rank0]: TypeError: ...` (Megatron-LM on an H200)
_RANK_RE = re.compile(r"^\[rank\d+\]:\s?")
# a glog-style prefix of a C++ log line: `[E1203 17:40:01.123 ProcessGroupNCCL.cpp:616] `
_GLOG_RE = re.compile(r"^(?:\[rank\d+\]:)?\[[EWIF]\d{4} [^\]]*\]\s*")
_CUDA_OOM_RE = re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory")
_HOST_OOM_RE = re.compile(r"DefaultCPUAllocator: can't allocate memory|^MemoryError\b")
_NCCL_RE = re.compile(
    r"NCCL.*(?:error|Error|timeout|timed out|Timeout\(ms\))|Watchdog caught collective|"
    r"DistBackendError|ncclSystemError|ncclInternalError|ncclUnhandledCudaError"
)
_EXCEPTION_RE = re.compile(
    r"^(?:[A-Za-z_][\w]*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Failure)\b(?::.*)?$"
)
MAX_REASON = 300


@dataclass(frozen=True)
class LaunchFailure:
    exit_code: int | None  # the failing worker's own exit code (negative: killed by a signal)
    rank: int | None
    signal: str | None  # SIGKILL, SIGABRT, ...
    reason: str | None  # the trainer's words: the line that says what went wrong


def _short(line: str) -> str:
    line = _GLOG_RE.sub("", line.strip())
    return line if len(line) <= MAX_REASON else line[: MAX_REASON - 3] + "..."


def worker_lines(console: str) -> list[str]:
    """The workers' own lines (torchrun's prefix removed), in order."""
    out = []
    for line in console.splitlines():
        match = _WORKER_RE.match(line)
        if match:
            out.append(_RANK_RE.sub("", match.group(2)))
    return out


def reason_in(lines: list[str]) -> str | None:
    """The line that best says why the trainer failed: out of memory first (it explains the
    rest), then NCCL, then the last exception line."""
    for pattern in (_CUDA_OOM_RE, _HOST_OOM_RE, _NCCL_RE):
        found = [line for line in lines if pattern.search(line.strip())]
        if found:
            return _short(found[0])
    exceptions = [
        line for line in lines
        if _EXCEPTION_RE.match(line.strip()) and "ChildFailedError" not in line
    ]  # fmt: skip
    return _short(exceptions[-1]) if exceptions else None


def read_failure(console: str, own_exit: int | None = None) -> LaunchFailure:
    """What torchrun and the workers said about a failed launch (fields None where silent).

    `own_exit`: the exit status of a trainer launched alone, without torchrun (rank 0; a
    negative status is the signal that killed it)."""
    root = _ROOT_CAUSE_RE.search(console)
    lines = worker_lines(console) or console.splitlines()
    reason = reason_in(lines)
    if root is not None:
        rank, code, sig = int(root.group(1)), int(root.group(2)), root.group(4)
    elif own_exit is not None:
        rank, code, sig = 0, own_exit, _signal_name(own_exit)
    else:
        return LaunchFailure(None, None, None, reason)
    if sig == "SIGKILL" and reason is None:
        reason = (
            "the kernel's out-of-memory killer sends SIGKILL when the host runs out of memory "
            "(see `dmesg`)"
        )
    return LaunchFailure(code, rank, sig, reason)


def _signal_name(exit_code: int) -> str | None:
    if exit_code >= 0:
        return None
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return None


def describe(exit_code: int | None, failure: LaunchFailure) -> str:
    """`trainer exited with code 3 (rank 0): ValueError: ...` in one line."""
    code = failure.exit_code if failure.exit_code is not None else exit_code
    if failure.signal:
        text = f"trainer killed by {failure.signal}"
    else:
        text = f"trainer exited with code {code}"
    if failure.rank is not None:
        text += f" (rank {failure.rank})"
    return text + (f": {failure.reason}" if failure.reason else "")


# ---- a build step's log ----------------------------------------------------------------------

# gcc and clang `file.cpp:12:5: error: ...` (and `fatal error:`), nvcc `kernel.cu(12): error: ...`
_COMPILER_ERROR_RE = re.compile(r"^\S.*?(?::\d+(?::\d+)?:|\(\d+\):) (?:fatal )?error\b")
# the linker: `undefined reference to ...`, `ld: cannot find -lfoo`, `collect2: error: ...`
_LINKER_ERROR_RE = re.compile(r"undefined reference to|\bld(?:\.\w+)?: |collect2: error")
# what a build tool says last: setuptools' `error: command 'gcc' failed ...`, make's
# `make: *** [Makefile:3: all] Error 1`, ninja's `FAILED: kernel.o`, pip's `ERROR: ...`
_TOOL_ERROR_RE = re.compile(r"^(?:error: |ERROR: |FAILED: )|\*\*\* .*Error \d+")
# pip's summary codes (`error: subprocess-exited-with-error`): the cause is on another line
_PIP_CODE_RE = re.compile(r"^error: [a-z]+(?:-[a-z]+)+$")


def build_error(log: str) -> str | None:
    """The line of a build's output that says why it failed: the first compiler error (the
    ones after it often follow from it), else the first linker error, else the last
    exception, else what the build tool said last."""
    lines = [line.rstrip() for line in log.splitlines()]
    for pattern in (_COMPILER_ERROR_RE, _LINKER_ERROR_RE):
        found = [line for line in lines if pattern.search(line)]
        if found:
            return _short(found[0])
    exceptions = [line for line in lines if _EXCEPTION_RE.match(line.strip())]
    if exceptions:
        return _short(exceptions[-1])
    said = [line.strip() for line in lines if not _PIP_CODE_RE.match(line.strip())]
    tools = [line for line in said if _TOOL_ERROR_RE.search(line)]
    return _short(tools[-1]) if tools else None
