"""The reference trainer's own runs: a resolved config file as the runner writes it, and
`python -m moe_perf.trainer ...` in a subprocess with its contract lines parsed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from moe_perf.common import contract

ROOT = Path(__file__).resolve().parents[2]


def write_config(tmp_path: Path, **sections) -> Path:
    """config.yaml in `tmp_path`: the tiny model on one CPU process; `sections` update it."""
    cfg = {
        "model": yaml.safe_load((ROOT / "conf" / "model" / "tiny.yaml").read_text()),
        "mesh": {"nnodes": 1, "nproc_per_node": 1, "pp": 1, "cp": 1, "ep": 1},
        "dtype": {"name": "fp32", "fp8": False},
        "training": {
            "sequence_length": 64,
            "global_batch": 4,
            "micro_batch": 1,
            "max_steps": 3,
            "seed": 5,
            "lr": 1e-3,
            "device": "cpu",
        },
        "data": {"corpus": None, "root": str(tmp_path / "datasets")},
        "trainer": yaml.safe_load((ROOT / "conf" / "trainer" / "reference.yaml").read_text()),
        "wandb": {"mode": "disabled"},  # sections the trainer does not read are ignored
    }
    for section, values in sections.items():
        cfg[section].update(values)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_trainer(args: list[str]) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """`python ARGS` from the repository root, one thread; (the process, its step lines)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    steps = [s for s in map(contract.parse_step, proc.stdout.splitlines()) if s]
    return proc, steps
