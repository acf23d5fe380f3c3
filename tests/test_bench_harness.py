"""bench/bench_harness.py: the harness benchmark, run for real on CPU with the tiny model.

The end-to-end test runs the script as a user would (two real sweeps of `python -m moe_perf` in
a temporary copy of this project) and checks the figures it writes; the others check the
trainer's plant point (`train.bench_hook`) and the harness's edit of it, with short real runs
of the reference trainer in this process.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import json
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest

from moe_perf.common import contract
from moe_perf.common.config import config_from_dict
from moe_perf.trainer import train

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "bench_harness.py"
TRAIN_PY = ROOT / "moe_perf" / "trainer" / "train.py"
# the smallest workload that still gives a median over a few measured steps (step 1 dropped)
SMALL = [
    "--set", "training.sequence_length=64",
    "--set", "training.global_batch=4",
    "--set", "training.max_steps=6",
    "--set", "timeout_s=240",
]  # fmt: skip


def load_script(name: str = "bench_harness"):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def tiny_config(steps: int):
    """The tiny model for a few CPU steps, composed by bench_trainer's Hydra composition."""
    raw = load_script("bench_trainer").trainer_config([
        "training.sequence_length=32", "training.global_batch=2", "training.micro_batch=1",
        f"training.max_steps={steps}", "training.device=cpu",
    ])  # fmt: skip
    return config_from_dict(raw)


def step_lines(text: str) -> list[dict]:
    return [s for s in map(contract.parse_step, text.splitlines()) if s]


def test_the_trainer_calls_bench_hook_once_per_timed_step(monkeypatch):
    out = io.StringIO()
    # each call records how many step lines were out by then: one call per step, before its line
    seen = []
    monkeypatch.setattr(train, "bench_hook", lambda: seen.append(len(step_lines(out.getvalue()))))
    train.run(tiny_config(steps=3), out=out)
    assert seen == [0, 1, 2]
    assert len(step_lines(out.getvalue())) == 3


def test_the_plant_replaces_only_the_hook_inside_the_timed_step():
    bench = load_script()
    text = TRAIN_PY.read_text()
    planted, line = bench.plant_slowdown(text, 0.0123, 0.5)
    lines, planted_lines = text.splitlines(), planted.splitlines()
    (hook,) = [n for n in ast.parse(text).body if getattr(n, "name", None) == "bench_hook"]
    assert hook.lineno == line and lines[line - 1] == "def bench_hook() -> None:"
    assert planted_lines[line - 1] == "def bench_hook() -> None:"
    assert planted_lines[line].startswith("    # planted by bench/bench_harness.py: --slowdown 0.5")
    assert planted_lines[line + 1] == "    seconds = 0.0123"
    body = len(bench.PLANTED_HOOK.splitlines())
    assert planted_lines[: line - 1] == lines[: line - 1]  # the rest of train.py as it was
    assert planted_lines[line - 1 + body :] == lines[hook.end_lineno :]
    bench.plant_slowdown(planted, 0.0123, 0.5)  # the planted file keeps the contract


def test_the_planted_delay_lands_in_every_timed_step(monkeypatch):
    bench = load_script()
    planted, _ = bench.plant_slowdown(TRAIN_PY.read_text(), 0.2, 1.0)
    module = types.ModuleType("planted_train")
    monkeypatch.setitem(sys.modules, module.__name__, module)  # for its dataclasses
    exec(compile(planted, str(TRAIN_PY), "exec"), module.__dict__)
    out = io.StringIO()
    module.run(tiny_config(steps=2), out=out)
    # a lower bound only: each timed step sleeps 0.2 s (no CUDA here) whatever else it does
    assert [s["step_time_s"] >= 0.2 for s in step_lines(out.getvalue())] == [True, True]


def test_a_missing_or_untimed_hook_fails_loudly():
    bench = load_script()
    text = TRAIN_PY.read_text()
    renamed = text.replace("def bench_hook() -> None:", "def bench_hook(step) -> None:")
    with pytest.raises(bench.BenchError, match="no top-level `def bench_hook"):
        bench.plant_slowdown(renamed, 0.01, 0.5)
    with pytest.raises(bench.BenchError, match="expected one `bench_hook\\(\\)` call"):
        bench.plant_slowdown(text.replace("    bench_hook()\n", ""), 0.01, 0.5)
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
        [sys.executable, str(SCRIPT), *SMALL, "--slowdown", "4.0", "--out", str(out),
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
    assert planted["expected_pct"] == pytest.approx(400.0)
    assert planted["delay_s"] == pytest.approx(4 * planted["aa_base_median_step_s"], rel=1e-3)
    # feat sleeps four A/A base medians per step: about +400%. Other tests' load (pytest -n 2 on
    # two cores) can slow this sweep's base several times over the A/A one, and the sleep does
    # not grow with load: the measured move is held against the delay over this sweep's base
    expected = planted["expected_pct_vs_this_base"]
    assert planted["measured_step_time_pct"] > max(25.0, 0.4 * expected), planted
    assert planted["measured_tokens_per_s_pct"] < -20
    shas = {a["arm"]: a["sha"] for a in sweeps["planted"]["arms"]}
    assert shas["feat"] == planted["sha"] != shas["base"] == aa["arms"][0]["sha"]

    env = report["environment"]
    assert env["world_size"] == 1 and env["torch"]
    assert "harness overhead" in result.stdout and "planted" in result.stdout
