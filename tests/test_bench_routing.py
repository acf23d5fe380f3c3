"""bench/bench_routing.sh, the GPU bench of step time against imbalance, as far as a CPU goes:
every sweep it runs composes and passes the prerequisites (dry_run=true), with the jobs and the
trainers' commands it would launch."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def titan_tree(tmp_path: Path) -> Path | None:
    """A torchtitan tree made of the installed package and a test tokenizer, or None."""
    spec = importlib.util.find_spec("torchtitan")
    if spec is None or spec.origin is None:
        return None
    tree = tmp_path / "titan"
    shutil.copytree(Path(spec.origin).parent, tree / "torchtitan",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    (tree / "tests/assets/tokenizer").mkdir(parents=True)
    (tree / "tests/assets/tokenizer/tokenizer.json").write_text("{}")
    return tree


def test_every_sweep_of_the_routing_bench_composes_and_passes_its_checks(tmp_path):
    tree = titan_tree(tmp_path)
    sweeps = "skew real" + (" titan_skew" if tree else "")
    env = {**os.environ, "PYTHON": sys.executable, "SWEEPS": sweeps, "IMBALANCES": "1,4",
           "REPEATS": "0", "EXTRA": "dry_run=true mesh.device_memory_gib=1000",
           "TMPDIR": str(tmp_path)}  # fmt: skip
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(ROOT / "bench/bench_routing.sh"), str(out),
                          *([str(tree)] if tree else [])],
                         env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "exit status" not in (out / "bench.txt").read_text()
    jobs = re.findall(r"#\d+ : (.*)", run.stdout)
    skew = [j for j in jobs if "routing=skew" in j and "trainer=torchtitan" not in j]
    # each job's overrides: the cell's, then arm, then repeat (the pairs sweeper's order)
    cells = [re.search(r"routing.imbalance=(\S+) .*arm=(\w+) repeat=0", j) for j in skew]
    assert [cell.groups() for cell in cells] == [
        ("1", "base"),
        ("1", "feat"),
        ("4", "base"),
        ("4", "feat"),
    ]
    assert sum("routing=real" in j for j in jobs) == 2
    assert all("model=qwen3-30b-a3b model.num_layers=4" in j for j in jobs)
    if tree:
        entries = [line for line in run.stdout.splitlines() if "moe_perf.titan_entry" in line]
        assert len(entries) == 4
        assert all("--skew-tokens 16384 --skew-experts 128 --skew-top-k 8" in e for e in entries)
        assert all("--debug.moe_force_load_balance" in e for e in entries)
