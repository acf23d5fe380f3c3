"""dtype=fp8 on a host that cannot run it: a prerequisite error before launch, not a failed arm."""

from __future__ import annotations

import importlib.util
import shutil

import pytest
from helpers.command import SMALL_RUN, moe_perf, sweep_dir
from helpers.repos import git

pytestmark = pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None,
    reason="the refusals are for a host without GPUs",
)

REFERENCE = [arg for arg in SMALL_RUN if not arg.startswith("trainer.")]


def assert_refused_before_launch(result, repo, message: str) -> None:
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert message in result.stderr
    assert "use dtype=bf16" in result.stderr
    assert "Traceback" not in result.stderr
    assert "nothing was launched" in result.stderr
    assert not list(sweep_dir(repo).glob("**/metrics.json"))
    assert not list(sweep_dir(repo).glob("**/console.log"))
    assert len(git(repo, "worktree", "list").splitlines()) == 1


@pytest.mark.slow
def test_fp8_without_an_fp8_gpu_is_refused_before_launch(ab_repo):
    # a contract trainer brings its own fp8: only the device is checked
    result = moe_perf(ab_repo, *SMALL_RUN, "dtype=fp8", "-m", "arm=base,feat")
    assert_refused_before_launch(result, ab_repo, "compute capability 8.9 or later")
    assert "no GPU (nvidia-smi)" in result.stderr


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torchao") is not None, reason="torchao is installed")
@pytest.mark.parametrize(
    "switch", [[], ["trainer.fp8_master_weights=true"]], ids=["plain", "masters"]
)
def test_fp8_of_the_reference_trainer_without_torchao_names_it(ab_repo, switch):
    result = moe_perf(
        ab_repo, *REFERENCE, "dtype=fp8", *switch, "training.device=auto", "-m", "arm=base,feat"
    )
    assert_refused_before_launch(result, ab_repo, "dtype=fp8 needs torchao")


@pytest.mark.slow
def test_fp8_on_cpu_is_refused(ab_repo):
    result = moe_perf(
        ab_repo, *SMALL_RUN, "dtype=fp8", "training.device=cpu", "-m", "arm=base,feat"
    )
    assert_refused_before_launch(result, ab_repo, "dtype=fp8 runs on GPUs only")


@pytest.mark.slow
def test_fp8_dry_run_previews_with_a_warning(ab_repo):
    result = moe_perf(ab_repo, *SMALL_RUN, "dtype=fp8", "dry_run=true", "-m", "arm=base,feat")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "warning (dry run; a real run stops here): dtype=fp8 needs GPUs" in result.stderr
    assert "feat: command " in result.stdout
