"""Shared fixtures: real git repositories in temp dirs, a small trainer, the real command.

Git identity comes from environment variables (set for the whole session, inherited by every
subprocess), so the tests need no global git config on a fresh machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# One thread per test process and trainer: a 2-core machine runs two pytest workers. Set before
# the test modules import torch at collection, so the tests' own torch reads it too.
os.environ.setdefault("OMP_NUM_THREADS", "1")

GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "moe_perf tests",
    "GIT_AUTHOR_EMAIL": "tests@moe-perf.invalid",
    "GIT_COMMITTER_NAME": "moe_perf tests",
    "GIT_COMMITTER_EMAIL": "tests@moe-perf.invalid",
    # never read the user's or the machine's git config (signing, hooks, default branch)
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}

# A trainer for tests: real work each step (a matmul loop), contract lines from rank 0.
# The feat branch of a test repository raises EXTRA_SLEEP_S to make each step measurably slower.
# numpy, not torch: what the tests check is the runner around the trainer, and a torch import is
# about 2 s of each rank's start-up on a 2-core machine (torchrun itself still imports torch).
SMALL_TRAINER = textwrap.dedent(
    '''
    """A small trainer for tests: real work per step (numpy), contract lines from rank 0."""
    import importlib.metadata
    import os
    import sys
    import time

    import numpy
    import yaml

    from moe_perf.common.contract import format_env, format_step
    from moe_perf.common.peak_rss import peak_rss_gib

    EXTRA_SLEEP_S = 0.0
    EXIT_AFTER_STEP = None  # tests of a failing arm set a step number

    cfg = yaml.safe_load(open(sys.argv[1]))
    # tests of "the user switches branch mid-sweep" move the user's checkout from inside an arm
    if os.environ.get("TEST_SWITCH_USER_BRANCH_TO") and os.environ.get("RANK", "0") == "0":
        import subprocess
        branch = os.environ["TEST_SWITCH_USER_BRANCH_TO"]
        subprocess.run(["git", "-C", cfg["repo"], "checkout", "-q", branch], check=True)
    steps = cfg["training"]["max_steps"]
    tokens = cfg["training"]["global_batch"] * cfg["training"]["sequence_length"]
    rank = int(os.environ.get("RANK", "0"))
    x = numpy.random.default_rng(cfg["training"]["seed"]).standard_normal((96, 96))
    if rank == 0:
        env = {"torch": importlib.metadata.version("torch"), "cuda": None, "nccl": None,
               "devices": [], "world_size": int(os.environ.get("WORLD_SIZE", "1"))}
        print(format_env(env), flush=True)
    for step in range(1, steps + 1):
        start = time.perf_counter()
        for _ in range(30):
            x = numpy.tanh(x @ x)
        time.sleep(EXTRA_SLEEP_S)
        seconds = time.perf_counter() - start
        peak_gib = peak_rss_gib()  # its own, not the runner's (ru_maxrss would be)
        if rank == 0:
            print(format_step(step, steps, step_time_s=seconds, tokens_per_s=tokens / seconds,
                              peak_mem_gib=peak_gib, loss=float(x.mean())), flush=True)
        if step == EXIT_AFTER_STEP:
            print("crashing on purpose", file=sys.stderr, flush=True)
            sys.exit(3)
    print(f"rank {rank} done", flush=True)
    '''
)

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


@pytest.fixture(autouse=True, scope="session")
def git_identity():
    saved = {key: os.environ.get(key) for key in GIT_IDENTITY}
    os.environ.update(GIT_IDENTITY)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


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


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return make_repo(tmp_path / "repo")


def trainer_variant(sleep_s: float = 0.0, exit_after_step: int | None = None) -> str:
    text = SMALL_TRAINER.replace("EXTRA_SLEEP_S = 0.0", f"EXTRA_SLEEP_S = {sleep_s}")
    return text.replace("EXIT_AFTER_STEP = None", f"EXIT_AFTER_STEP = {exit_after_step}")


def make_ab_repo(path: Path, slowdown_s: float = 0.05, base: str = SMALL_TRAINER,
                 feat: str | None = None) -> Path:  # fmt: skip
    """`main` with the small trainer; `feature` (checked out) sleeps `slowdown_s` per step."""
    make_repo(path, {"mytrainer/__main__.py": base, ".gitignore": "__pycache__/\n"})
    git(path, "checkout", "-q", "-b", "feature")
    commit(path, {"mytrainer/__main__.py": feat or trainer_variant(slowdown_s)}, "feature")
    return path


@pytest.fixture
def ab_repo(tmp_path: Path) -> Path:
    return make_ab_repo(tmp_path / "repo")


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
