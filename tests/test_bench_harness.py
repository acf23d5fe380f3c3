"""bench/bench_harness.py: the harness benchmark, run for real on CPU with the tiny model.

The end-to-end test runs the script as a user would (two real sweeps of `python -m moe_perf` in
a temporary copy of this project) and checks the figures it writes; the others check the
planted edit of train.py without running anything.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "bench_harness.py"
# the smallest workload that still gives a median over a few measured steps (step 1 dropped)
SMALL = [
    "--set", "training.sequence_length=64",
    "--set", "training.global_batch=4",
    "--set", "training.max_steps=6",
    "--set", "timeout_s=240",
]  # fmt: skip


def load_script():
    if "bench_harness" in sys.modules:
        return sys.modules["bench_harness"]
    spec = importlib.util.spec_from_file_location("bench_harness", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_harness"] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def committed_train_py() -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), "show", "HEAD:moe_perf/trainer/train.py"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip


def test_the_planted_sleep_goes_inside_the_timed_step():
    bench = load_script()
    text = committed_train_py()
    planted, line = bench.plant_slowdown(text, 0.0123, 0.5)
    lines = planted.splitlines()
    assert lines[line - 1].strip().startswith("_planted_delay(0.0123)")
    assert lines[line].strip() == "optimizer.step()"
    assert len(lines) == len(text.splitlines()) + len(bench.PLANTED_FN.splitlines()) + 1
    before, after = planted.split("_planted_delay(0.0123)")
    assert "t0 = time.perf_counter()" in before and "time.perf_counter() - t0" in after
    assert before.count("def _planted_delay(") == 1
    compile(planted, "train.py", "exec")  # still valid Python

    # The planted function delays by what it is asked, here on the host (no CUDA).
    import time as time_module

    import torch

    namespace = {"time": time_module, "torch": torch}
    exec(bench.PLANTED_FN, namespace)
    t0 = time_module.perf_counter()
    namespace["_planted_delay"](0.05)
    if not torch.cuda.is_available():
        assert time_module.perf_counter() - t0 >= 0.05


def test_a_missing_anchor_fails_loudly():
    bench = load_script()
    text = committed_train_py()
    with pytest.raises(bench.BenchError, match="optimizer.step"):
        bench.plant_slowdown(text.replace("optimizer.step()", "opt.step()"), 0.01, 0.5)
    outside = text.replace("t0 = time.perf_counter()", "t0 = time.monotonic()")
    with pytest.raises(bench.BenchError, match="not be timed"):
        bench.plant_slowdown(outside, 0.01, 0.5)


def test_keys_the_harness_sets_are_refused(capsys):
    bench = load_script()
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--set", "refs.feat=other"])
    assert exit_info.value.code == 2
    assert "refs.feat" in capsys.readouterr().err
    assert bench.parse_args([]).overrides == ["wandb.mode=disabled"]
    assert bench.parse_args(["--set", "wandb.mode=offline"]).overrides == ["wandb.mode=offline"]


@pytest.mark.slow
def test_harness_benchmark_on_cpu(tmp_path):
    out = tmp_path / "harness.json"
    work = tmp_path / "work"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *SMALL, "--slowdown", "2.0", "--out", str(out),
         "--workdir", str(work)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["schema"] == "moe_perf.bench_harness/1"
    assert list(work.iterdir()) == []  # the temporary directory is gone

    sweeps = report["sweeps"]
    assert set(sweeps) == {"aa", "planted"}
    for name, sweep in sweeps.items():
        assert sweep["command"][1:3] == ["-m", "moe_perf"], name
        assert sweep["command"][-2:] == ["-m", "arm=base,feat"], name
        feat_ref = {"aa": "main", "planted": "slow"}[name]
        assert "refs.base=main" in sweep["command"] and f"refs.feat={feat_ref}" in sweep["command"]
        assert sweep["arms_run"] == 2 and [a["arm"] for a in sweep["arms"]] == ["base", "feat"]
        assert sweep["wall_s"] > sweep["trainer_wall_sum_s"] > 0
        assert 0 < sweep["harness_overhead_per_arm_s"] < 30
        assert all(a["in_arm_overhead_s"] >= 0 for a in sweep["arms"])
        (group,) = sweep["groups"]
        assert group["status"] == "compared" and group["tag"] == "pp1-dp1-cp1-ep1-seq64-fp32"
    assert 0 < report["harness_overhead_per_arm_s"]["aa"] < 30

    aa = sweeps["aa"]
    assert aa["groups"][0]["aa"] is True
    assert len({a["sha"] for a in aa["arms"]}) == 1
    assert all(math.isfinite(v) for v in report["aa_diff_pct"].values())

    planted = report["planted_slowdown"]
    assert planted["expected_pct"] == pytest.approx(200.0)
    assert planted["delay_s"] == pytest.approx(2 * planted["aa_base_median_step_s"], rel=1e-3)
    # feat sleeps two A/A base medians per step: about +200%. A/A noise on a busy 2-core
    # machine reaches +-25%, and a base slowed by load between the sweeps shrinks the ratio
    # (the sleep does not grow with load), hence the wide range
    assert 50 < planted["measured_step_time_pct"] < 600
    assert planted["measured_tokens_per_s_pct"] < -30
    shas = {a["arm"]: a["sha"] for a in sweeps["planted"]["arms"]}
    assert shas["feat"] == planted["sha"] != shas["base"] == aa["arms"][0]["sha"]

    env = report["environment"]
    assert env["world_size"] == 1 and env["torch"]
    assert "harness overhead" in result.stdout and "planted" in result.stdout
