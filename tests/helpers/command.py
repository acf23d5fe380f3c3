"""The real command, `python -m moe_perf ARGS`, the overrides that keep a run small, and what
the tests read of its results and of the machine's processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# Overrides that select the small trainer and keep a run to a few seconds on CPU.
SMALL_RUN = [
    "trainer.command=[-m,mytrainer]",
    "trainer.code_path=mytrainer",
    "training.sequence_length=64",
    "training.global_batch=4",
    "training.max_steps=6",
    "wandb.mode=disabled",
    "timeout_s=120",
    # one base/feat pair, as the seed ran it; the verdict's own tests add pairs (repeat=auto)
    "compare.max_pairs=1",
]


def moe_perf(
    cwd: Path, *args: str, timeout: float = 240, env: dict | None = None
) -> subprocess.CompletedProcess:
    """The real command, `python -m moe_perf ARGS`, run in `cwd`."""
    return subprocess.run(
        [sys.executable, "-m", "moe_perf", *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def sweep_dir(repo: Path) -> Path:
    return repo / "outputs" / "validate-performance"


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that mention `text` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline}")
    return found
