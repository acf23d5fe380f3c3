"""Fixtures over tests/helpers/: real git repositories in temp dirs and the git identity.

Git identity comes from environment variables (set for the whole session, inherited by every
subprocess), so the tests need no global git config on a fresh machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# One thread per test process and trainer: a 2-core machine runs two pytest workers. Set before
# the test modules import torch at collection, so the tests' own torch reads it too.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from helpers.repos import GIT_IDENTITY, make_ab_repo, make_repo  # noqa: E402


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


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return make_repo(tmp_path / "repo")


@pytest.fixture
def ab_repo(tmp_path: Path) -> Path:
    return make_ab_repo(tmp_path / "repo")


def pytest_configure(config: pytest.Config) -> None:
    """`-n 2` without `--dist` schedules by work stealing. The suite mixes real sweeps of tens
    of seconds with in-process tests of milliseconds: xdist's default (`load`) hands out chunks
    of tests that stay with their worker, so one worker can be left with the last chunk's
    sweeps while the other waits; with `worksteal` an idle worker takes half of the other's
    queue (pytest-xdist 3.2 or later)."""
    chosen = any(arg.startswith("--dist") for arg in config.invocation_params.args)
    if getattr(config.option, "dist", "no") == "load" and not chosen:
        config.option.dist = "worksteal"
