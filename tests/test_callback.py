"""The Hydra callback in a real multirun: a tiny @hydra.main app writes arm records into its
sweep directory the way the runner does, and CompareCallback prints the comparison at the end.
Independent of the runner's CLI on purpose."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.pictures import png_pixels
from omegaconf import OmegaConf

from moe_perf.report.results import Comparison
from moe_perf.runner import callback
from moe_perf.runner.callback import CompareCallback

APP = textwrap.dedent(
    '''
    """A stand-in for the runner: one arm's console log and metrics.json per job."""
    import dataclasses
    from pathlib import Path

    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from moe_perf.report.comparison import record_from_log
    from moe_perf.common.contract import format_step


    @hydra.main(version_base="1.3", config_path=".", config_name="app")
    def main(cfg):
        arm_dir = Path(HydraConfig.get().runtime.output_dir)
        arm_dir.mkdir(parents=True, exist_ok=True)
        slowdown = cfg.slowdown if cfg.arm == "feat" else 1.0
        lines = ["starting"]
        if cfg.arm != cfg.fail_arm:
            for step in range(1, 9):
                t = (1.0 if step == 1 else 0.1 * slowdown) * (1 + 0.001 * cfg.repeat)
                lines.append(format_step(step, 8, step_time_s=t, tokens_per_s=256 / t,
                                         peak_mem_gib=0.5, loss=5.0))
        log = arm_dir / "console.log"
        log.write_text("\\n".join(lines) + "\\n")
        record = record_from_log(log, cfg.arm, "contract")
        record = dataclasses.replace(record, model=cfg.model, tag=cfg.tag, repeat=cfg.repeat,
                                     sha="d" * 40, ref=cfg.arm, arm_dir=str(arm_dir),
                                     config=OmegaConf.to_container(cfg, resolve=True))
        if cfg.arm == cfg.fail_arm:
            record = dataclasses.replace(record, exit_code=1,
                                         failure="trainer exited with code 1 (planted)")
        record.dump(arm_dir / "metrics.json")


    if __name__ == "__main__":
        main()
    '''
)

CONFIG = textwrap.dedent(
    """
    model: tiny
    tag: pp1-dp1-cp1-ep1-seq64-bf16
    arm: base
    repeat: 0
    slowdown: 1.2
    fail_arm: none
    hydra:
      callbacks:
        compare:
          _target_: moe_perf.runner.callback.CompareCallback
      sweep:
        dir: sweep
        subdir: ${model}/${tag}-${arm}-r${repeat}
      job:
        chdir: false
    """
)


def run_sweep(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "app.yaml").write_text(CONFIG)
    return subprocess.run(
        [sys.executable, "app.py", "-m", *overrides],
        cwd=tmp_path,  # the sweep dir is relative: the callback must resolve it from here
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_multirun_prints_comparison_with_repeats(tmp_path):
    result = run_sweep(tmp_path, "arm=base,feat", "repeat=0,1")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "## tiny  pp1-dp1-cp1-ep1-seq64-bf16" in out
    assert "A/A run" in out  # both arms carry the same sha in this stand-in
    assert "| base | 2 | 0.1001 [0.1000-0.1001]" in out
    assert "| feat vs base |  | +20.00% (slower)" in out
    assert re.search(r"^\[moe_perf\] tiny \S+: step time .*DIFFERENT", out, re.M), out
    sweep = tmp_path / "sweep"
    assert (sweep / "comparison.md").read_text() in out
    assert (sweep / "comparison.json").exists()
    assert png_pixels(sweep / "comparison.png") == (1300, 380)  # one row: one (model, tag)
    listed = out.split("[moe_perf] files written:\n", 1)[1]
    assert listed.startswith(f"  {sweep}/  comparison.json comparison.md comparison.png")
    assert (
        "  tiny/pp1-dp1-cp1-ep1-seq64-bf16-feat-r1/  .hydra/ app.log console.log metrics.json"
        in listed
    )
    last = out.rstrip().splitlines()[-1]  # the sweep ends with its verdict
    assert last.startswith("[moe_perf] tiny pp1-dp1-cp1-ep1-seq64-bf16: step time ")
    assert "DIFFERENT" in last and last.endswith("A/A run (one commit), so any difference is noise")


@pytest.mark.slow
def test_multirun_failed_arm_is_shown(tmp_path):
    result = run_sweep(tmp_path, "arm=base,feat", "fail_arm=feat")
    assert result.returncode == 3, result.stderr  # after the comparison is printed and written
    log = tmp_path / "sweep" / "tiny" / "pp1-dp1-cp1-ep1-seq64-bf16-feat-r0" / "console.log"
    assert "| feat | failed |" in result.stdout
    assert f"feat r0 FAILED: trainer exited with code 1 (planted); log: {log}" in result.stdout
    assert "not compared, no successful run of feat (1 of 2 runs failed)" in result.stdout
    assert "1 run(s) of this sweep failed: exit code 3" in result.stderr


def test_callback_never_raises(capsys):
    CompareCallback().on_multirun_end(OmegaConf.create({"hydra": {}}))
    err = capsys.readouterr().err
    assert "[moe_perf] could not compare the sweep" in err
    assert "python -m moe_perf.compare" in err


def test_callback_constructs_without_arguments(tmp_path, capsys):
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    CompareCallback().on_multirun_end(config)
    assert "No arm records (metrics.json) found." in capsys.readouterr().out


def test_the_files_written_include_the_explain_picture(tmp_path):
    for name in ("comparison.md", "comparison.json", "comparison.png", "explain.png"):
        (tmp_path / name).write_text("")
    nothing = Comparison(groups=(), created="2026-01-01T00:00:00+00:00", sweep_id=None,
                         unstable_spread=0.2)  # fmt: skip
    (top,) = callback.written_files(nothing, tmp_path)
    assert top.split()[1:] == ["comparison.json", "comparison.md", "comparison.png", "explain.png"]
