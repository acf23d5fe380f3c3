"""Real git repositories in temp dirs: a plain one, an A/B one with the small trainer on two
branches, and a copy of this project's package."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMALL_TRAINER = Path(__file__).with_name("small_trainer.py").read_text()

GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "moe_perf tests",
    "GIT_AUTHOR_EMAIL": "tests@moe-perf.invalid",
    "GIT_COMMITTER_NAME": "moe_perf tests",
    "GIT_COMMITTER_EMAIL": "tests@moe-perf.invalid",
    # never read the user's or the machine's git config (signing, hooks, default branch)
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def write(repo: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def commit(repo: Path, files: dict[str, str], message: str) -> str:
    write(repo, files)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


def make_repo(path: Path, files: dict[str, str] | None = None) -> Path:
    """A git repository on branch `main` with one commit."""
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q", "-b", "main")
    commit(path, files or {"README.md": "a repository under test\n"}, "initial")
    return path


def trainer_files(sleep_s: float = 0.0, exit_after_step: int | None = None) -> dict[str, str]:
    """The small trainer as package `mytrainer`, with the knobs that choose its behaviour."""
    knobs = {"sleep_s": sleep_s, "exit_after_step": exit_after_step}
    return {"mytrainer/__main__.py": SMALL_TRAINER, "mytrainer/knobs.json": json.dumps(knobs)}


def make_ab_repo(path: Path, slowdown_s: float = 0.05, base: dict[str, str] | None = None,
                 feat: dict[str, str] | None = None) -> Path:  # fmt: skip
    """`main` with the small trainer; `feature` (checked out) sleeps `slowdown_s` per step.
    `base`/`feat`: other trainer_files for a branch."""
    make_repo(path, {**(base or trainer_files()), ".gitignore": "__pycache__/\n"})
    git(path, "checkout", "-q", "-b", "feature")
    commit(path, feat or trainer_files(sleep_s=slowdown_s), "feature")
    return path


def copy_of_moe_perf(path: Path) -> Path:
    """A repository holding this project's package (runner and reference trainer)."""
    sources = [p for p in (ROOT / "moe_perf").rglob("*.py") if "__pycache__" not in p.parts]
    files = {str(p.relative_to(ROOT)): p.read_text() for p in sources}
    files[".gitignore"] = "__pycache__/\n"
    return make_repo(path, files)
