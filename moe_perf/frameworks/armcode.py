"""Reading an arm's own code before and after its worktree exists.

An adapter decides what to run from the framework's code at the arm's commit (which CLI its
torchtitan has, whether a model is there), not from what is installed. Before launch, the arm
is a ref in the repository (`git cat-file`, nothing checked out); at launch it is the worktree.
Both answer the same two questions, so one rule serves the preflight and the launch.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


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
