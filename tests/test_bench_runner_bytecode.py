"""bench/bench_runner_bytecode.py: both conditions of each command run, and only the kept one
leaves the runner's bytecode in the machine's cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_the_bench_times_both_conditions_and_keeps_bytecode_only_in_one(tmp_path):
    sweep = ROOT / "tests" / "data" / "results" / "ab_repeats"
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_runner_bytecode.py"), str(out), "--runs",
         "1", "--sweep", str(sweep)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    figures = json.loads((out / "runner_bytecode.json").read_text())
    for condition in ("kept", "compiled"):
        for name in ("dry run", "compare"):
            (wall,) = figures["walls_s"][condition][name]
            assert wall > 0
            assert f"| {name} |" in done.stdout
    tag = sys.implementation.cache_tag
    kept = list((out / "xdg" / "moe_perf" / "pycache").rglob(f"moe_perf/report/cli.{tag}.pyc"))
    assert len(kept) == 1  # the comparison's own module, kept for the next command
    assert not (out / "empty").exists()  # the compiled condition's prefixes, removed
    # the comparison ran on a copy: the test data is left as it was
    assert (out / "sweep" / "comparison.png").is_file()
    assert not (sweep / "comparison.png").exists()
