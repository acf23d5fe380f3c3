"""A CPU trainer's peak memory is its own: launched by a runner that holds a large allocation,
the test trainer (tests/helpers/small_trainer.py) and the reference trainer report what they
hold themselves, not the runner's peak that ru_maxrss carries over fork and exec.

The chain is real: a Python process touches BALLAST_MIB of memory, then starts the trainer with
the runner's own launch code (launchers/process.run_trainer), which parses its step lines.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from helpers.repos import SMALL_TRAINER

from moe_perf.common.peak_rss import peak_rss_gib

BALLAST_MIB = 1024
pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux /proc")

# The runner stand-in: holds the ballast (every page written, so resident), then launches.
RUNNER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from moe_perf.launchers.process import run_trainer
    ballast = b"x" * ({mib} << 20)
    argv, arm_dir = json.loads(sys.argv[1]), Path(sys.argv[2])
    result = run_trainer(argv, cwd=arm_dir, arm_dir=arm_dir, label="base", timeout_s=120,
                         kill_grace_s=5, max_steps=3, one_process=True, echo=sys.stderr,
                         env={{"RANK": "0", "WORLD_SIZE": "1"}})
    print(json.dumps({{"failure": result.failure,
                      "peaks": [s["peak_mem_gib"] for s in result.steps],
                      "runner_gib": len(ballast) / 2**30}}))
    """
)


def launched_by_a_large_runner(tmp_path: Path, argv: list[str]) -> dict:
    script = RUNNER.format(mib=BALLAST_MIB)
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(argv), str(tmp_path)],
                          capture_output=True, text=True, timeout=180, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["failure"] is None, out["failure"]
    assert len(out["peaks"]) == 3
    return out


@pytest.mark.slow
def test_the_test_trainer_reports_its_own_peak_not_its_runners(tmp_path):
    (tmp_path / "mytrainer").mkdir()
    (tmp_path / "mytrainer" / "__main__.py").write_text(SMALL_TRAINER)
    config = {"repo": str(tmp_path), "training": {"max_steps": 3, "global_batch": 4,
                                                  "sequence_length": 64, "seed": 1}}  # fmt: skip
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    out = launched_by_a_large_runner(
        tmp_path, [sys.executable, "-m", "mytrainer", str(tmp_path / "config.yaml")]
    )
    # numpy and a 96x96 matrix: tens of MiB, against the runner's 1 GiB
    assert max(out["peaks"]) < 0.25 * out["runner_gib"], out


@pytest.mark.slow
def test_the_reference_trainers_cpu_peak_is_its_own(tmp_path):
    step = textwrap.dedent(
        """
        import torch
        from moe_perf.common.contract import format_step
        from moe_perf.trainer.runtime import peak_memory_gib
        for step in (1, 2, 3):
            peak = peak_memory_gib(torch.device("cpu"))
            print(format_step(step, 3, step_time_s=0.1, tokens_per_s=1.0, peak_mem_gib=peak))
        """
    )
    out = launched_by_a_large_runner(tmp_path, [sys.executable, "-c", step])
    # Python with torch loaded: about 0.2 GiB on CPU, against the runner's 1 GiB
    assert 0.05 < max(out["peaks"]) < 0.6 * out["runner_gib"], out


def test_this_process_peak_grows_with_what_it_touches():
    before = peak_rss_gib()
    held = b"y" * (256 << 20)
    assert peak_rss_gib() - before > 0.2, len(held)
