"""Reading an arm's own code before and after its worktree exists.

An adapter decides what to run from the framework's code at the arm's commit (which CLI its
torchtitan has, whether a model is there), not from what is installed. Before launch, the arm
is a ref in the repository (`git cat-file`, nothing checked out); at launch it is the worktree.
Both answer the same two questions, so one rule serves the preflight and the launch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from moe_perf.common.errors import PrerequisiteError


class ArmCode:
    """The files of one arm: a directory (its worktree) or `ref` in the repository `repo`."""

    def __init__(self, root: Path, ref: str | None = None):
        self.root = Path(root)
        self.ref = ref

    @classmethod
    def at_ref(cls, repo: Path, ref: str) -> ArmCode:
        return cls(repo, ref)

    def where(self) -> str:
        return f"{self.ref} in {self.root}" if self.ref else str(self.root)

    def has(self, path: str) -> bool:
        if self.ref is None:
            return (self.root / path).exists()
        return self._git("cat-file", "-e", f"{self.ref}:{path.strip('/')}") is not None

    def read(self, path: str) -> str | None:
        if self.ref is None:
            file = self.root / path
            return file.read_text(errors="replace") if file.is_file() else None
        return self._git("show", f"{self.ref}:{path.strip('/')}")

    def _git(self, *args: str) -> str | None:
        proc = subprocess.run(
            ["git", "-C", str(self.root), *args], capture_output=True, text=True, check=False
        )
        return proc.stdout if proc.returncode == 0 else None


def visible_gpus() -> int:
    """CUDA devices `nvidia-smi -L` lists on this host (0 without a driver).

    The runner never imports torch, so the driver's own tool answers; CUDA_VISIBLE_DEVICES,
    when set, narrows the count as it narrows what the trainer sees.
    """
    try:
        proc = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, check=False, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    listed = sum(1 for line in proc.stdout.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        listed = min(listed, len([d for d in visible.split(",") if d.strip()]))
    return listed if proc.returncode == 0 else 0


FP8_COMPUTE_CAPABILITY = (8, 9)  # Ada and Hopper onwards have fp8 tensor cores


def gpu_compute_capabilities() -> list[tuple[int, int]]:
    """(major, minor) of each GPU nvidia-smi lists; empty without a driver."""
    query = ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"]
    try:
        proc = subprocess.run(query, capture_output=True, text=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if proc.returncode != 0:
        return []
    found = []
    for line in proc.stdout.split():
        major, _, minor = line.strip().partition(".")
        if major.isdigit() and minor.isdigit():
            found.append((int(major), int(minor)))
    return found


def check_fp8_host(cfg: Any, torchao: bool = True, python: str = sys.executable) -> None:
    """dtype=fp8 trains on fp8-capable GPUs, through torchao's float8 linears where `torchao`
    (the reference trainer, torchtitan): both checked on this host before anything launches
    (the arms run this interpreter), so a missing piece is never a failed arm."""
    if not cfg.dtype.fp8:
        return
    if str(cfg.training.device) == "cpu":
        raise PrerequisiteError(
            "dtype=fp8 runs on GPUs only and training.device=cpu: use dtype=bf16"
        )
    if torchao:
        check_torchao(python)
    capabilities = gpu_compute_capabilities()
    slow = [f"{a}.{b}" for a, b in capabilities if (a, b) < FP8_COMPUTE_CAPABILITY]
    if not capabilities or slow:
        have = f"compute capability {', '.join(slow)}" if slow else "no GPU (nvidia-smi)"
        raise PrerequisiteError(
            f"dtype=fp8 needs GPUs of compute capability 8.9 or later (H100, H200, L40S); this "
            f"host has {have}: use dtype=bf16"
        )


def check_torchao(python: str) -> None:
    probe = [python, "-c", "import importlib.util as u; print(u.find_spec('torchao') is not None)"]
    try:
        found = subprocess.run(probe, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        found = ""
    if found != "True":
        raise PrerequisiteError(
            f"dtype=fp8 needs torchao in {python} (pip install 'moe_perf[fp8]', or a torchao "
            "built for this torch); or use dtype=bf16"
        )
