"""Framework log adapters (REFERENCE §4) and the compare CLI on torchtitan / Megatron-LM logs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moe_perf.report import logparse

ANSI_GREEN, ANSI_RESET = "\x1b[32m", "\x1b[39m"


def titan_line(step: int, tps: int, mfu: str = "N/A", memory: float = 4.26) -> str:
    return (
        f"[rank0]:[titan] 2026-07-17 12:05:19,496 - root - INFO - {ANSI_GREEN}step: {step:2d}  "
        f"loss:  6.09081  grad_norm:  4.2098  memory: {memory:5.2f}GiB(2.39%)  "
        f"tps: {tps:,}  tflops: 39.59  mfu: {mfu}{ANSI_RESET}"
    )


def megatron_line(step: int, ms: float, total: int = 100) -> str:
    return (
        f" [2024-04-06 02:59:36] iteration {step:8d}/{total:8d} | consumed samples: "
        f"{step * 128:12d} | elapsed time per iteration (ms): {ms:.1f} | throughput per GPU "
        "(TFLOP/s/GPU): 239.8 | learning rate: 8.600000E-06 | global batch size:   128 | "
        "lm loss: 1.825991E+00 | loss scale: 1.0 | grad norm: 0.456 | number of skipped "
        "iterations:   0 | number of nan iterations:   0 |"
    )


MEGATRON_MEMORY = (
    "[Rank 0] (after 2 iterations) memory (MB) | allocated: 30000.5 | max allocated: 40000.0 "
    "| reserved: 45000.0 | max reserved: 46080.0"
)


def test_titan_line():
    sample = logparse.parse_titan_line(titan_line(2, 72915, mfu="38.12%"), tokens_per_step=8192)
    assert sample["step"] == 2
    assert sample["tokens_per_s"] == 72915.0
    assert sample["peak_mem_gib"] == pytest.approx(4.26)
    assert sample["loss"] == pytest.approx(6.09081)
    assert sample["tflops"] == pytest.approx(39.59)
    assert sample["mfu"] == pytest.approx(0.3812)
    assert sample["step_time_s"] == pytest.approx(8192 / 72915)


def test_titan_line_without_step_time_or_mfu():
    sample = logparse.parse_titan_line(titan_line(3, 70000))
    assert sample["mfu"] is None and sample["step_time_s"] is None
    assert logparse.parse_titan_line("[titan] INFO - Training starts at step 1") is None


def test_megatron_lines_with_memory_report():
    lines = [megatron_line(1, 9000.0), MEGATRON_MEMORY, megatron_line(2, 5444.9)]
    samples, used = logparse.parse_lines(lines, "auto", seq_length=4096)
    assert used == "megatron"
    assert [s["step"] for s in samples] == [1, 2]
    second = samples[1]
    assert second["step_time_s"] == pytest.approx(5.4449)
    assert second["tflops"] == pytest.approx(239.8)
    assert second["loss"] == pytest.approx(1.825991)
    assert second["tokens_per_s"] == pytest.approx(128 * 4096 / 5.4449)
    assert second["peak_mem_gib"] == pytest.approx(45.0)  # max reserved, MB -> GiB


def test_auto_prefers_the_format_with_most_steps():
    lines = [titan_line(k, 70000) for k in range(1, 5)]
    samples, used = logparse.parse_lines(lines)
    assert used == "titan" and len(samples) == 4
    with pytest.raises(ValueError, match="unknown log format"):
        logparse.parse_lines(lines, "nemo")


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moe_perf.compare", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_cli_titan_logs(tmp_path):
    base = write(tmp_path / "base.log", [titan_line(k, 80000) for k in range(1, 9)])
    feat = write(tmp_path / "feat.log", [titan_line(k, 72000) for k in range(1, 9)])
    result = run_cli(str(base), str(feat), "--format", "titan", "--tokens-per-step", "8192")
    assert result.returncode == 0, result.stderr
    assert "base: " in result.stdout and "(titan)" in result.stdout
    # 80000 -> 72000 tokens/s: step time +11.11%, tokens/s -10%
    assert "| feat vs base |  | +11.11% (slower) | -10.00% (slower) |" in result.stdout


def test_cli_megatron_logs_auto(tmp_path):
    def log(ms: float) -> list[str]:
        return [megatron_line(1, 9000.0), MEGATRON_MEMORY] + [
            megatron_line(k, ms) for k in range(2, 9)
        ]

    base = write(tmp_path / "base.log", log(5000.0))
    feat = write(tmp_path / "feat.log", log(5250.0))
    result = run_cli(str(base), str(feat), "--seq-length", "4096")
    assert result.returncode == 0, result.stderr
    assert "(megatron)" in result.stdout
    assert (
        "| feat vs base |  | +5.00% (slower) | -4.76% (slower) | +0.00% (same) |" in result.stdout
    )
    assert "TFLOP/s" in result.stdout
