"""bench/gpu_time_to_decision.sh on the CPU: its argument handling, its dry run (every part's
command, whose overrides compose into the config through Hydra and bench_trainer.py's own
parser), and (slow) its --smoke run end to end at the tiny model's shapes, which writes what
the device brings back (at most 8 files, none below OUT/a/b)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.compose import composed

from moe_perf.runner import schema

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_time_to_decision.sh"
sys.path.insert(0, str(ROOT / "bench"))

import bench_startup  # noqa: E402
import bench_trainer  # noqa: E402


def script(*args: str, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)  # fmt: skip


def planned(stdout: str) -> dict[str, list[str]]:
    """{label: argv} of the dry run's `+ [label] command` lines."""
    plan = {}
    for line in stdout.splitlines():
        if line.startswith("+ ["):
            label, _, command = line[3:].partition("] ")
            plan[label] = shlex.split(command)
    return plan


def values_after(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == flag]


def assert_composes(overrides: list[str]) -> None:
    cfg = composed(*overrides)
    assert schema.unknown_keys(cfg) == [] and schema.out_of_range(cfg) == []


@pytest.mark.slow
@pytest.mark.parametrize("args", [[], ["out", "--bogus"], ["--dry-run"], ["a", "b", "c"]])
def test_bad_arguments_give_the_usage_and_exit_2(args):
    result = script(*args)
    assert result.returncode == 2 and "usage: bash bench/gpu_time_to_decision.sh" in result.stderr


@pytest.mark.slow
def test_a_directory_that_holds_results_is_refused_untouched(tmp_path):
    (tmp_path / "summary.md").write_text("earlier figures\n")
    result = script(str(tmp_path))
    assert result.returncode == 2 and "is not empty" in result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["summary.md"]


@pytest.mark.slow
def test_the_dry_run_plans_every_part_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    result = script(str(out), "--dry-run", BUDGET_S="1", PYTHONDONTWRITEBYTECODE="1")
    assert result.returncode == 0, result.stderr
    assert not out.exists()
    plan = planned(result.stdout)
    warm = ["warmup-off-1", "warmup-on-1", "warmup-on-2", "warmup-off-2"]
    steps = ["step-bf16-1", "step-fp8-1", "step-fp8mw-1", "step-fp8mw-2", "step-fp8-2",
             "step-bf16-2"]  # fmt: skip
    sweeps = ["sweep-off-1", "sweep-on-1", "sweep-on-2", "sweep-off-2"]
    cold = ["cold-off", "cold-on", "breakdown-cold"]
    carried = ["carried", "carried-arm-pool", "carried-bytecode"]
    assert list(plan) == ["startup", *carried, *warm, "breakdown", *steps, *sweeps,
                          "runner-bytecode", *cold]  # fmt: skip
    assert plan["runner-bytecode"][1].endswith("bench/bench_runner_bytecode.py")
    assert values_after(plan["runner-bytecode"], "--runs") == ["3"]
    assert "not run: torchtitan" in result.stdout

    for label in ["startup", *carried, *warm, "breakdown", *sweeps, *cold]:
        argv = plan[label]
        assert argv[1].endswith("bench/bench_startup.py")
        sets = dict(item.partition("=")[::2] for item in values_after(argv, "--set"))
        shapes = {**bench_startup.SHAPES, **sets}
        assert shapes["training.micro_batch"] == "8" and shapes["training.max_steps"] == "10"
        assert_composes([f"{k}={v}" for k, v in shapes.items()])
    assert all("--warm" in plan[label] for label in [*carried, *warm, "breakdown"])
    assert not any("--warm" in plan[label] for label in ["startup", *cold])
    for label in ("breakdown", "breakdown-cold"):  # attributed: sampled stacks, timed imports
        assert "trainer.sample_stacks_ms=5" in values_after(plan[label], "--set")
    caches = [values_after(plan[label], "--cache") for label in ["startup", *cold]]
    assert len({c[0] for c in caches}) == len(caches)  # each cold arm an empty cache of its own
    # part 8: copies of part 1's cache, loaded with an empty bytecode directory, then with a
    # copy of part 1's
    assert values_after(plan["carried"], "--cache") == ["<WORK>/cache-carried"]
    assert values_after(plan["carried"], "--env") == ["XDG_CACHE_HOME=<WORK>/xdg-fresh"]
    assert values_after(plan["carried-arm-pool"], "--cache") == ["<WORK>/cache-carried3"]
    assert values_after(plan["carried-arm-pool"], "--env") == [
        "XDG_CACHE_HOME=<WORK>/xdg-fresh-pool", "MOE_PERF_BYTECODE_POOL=arm"]  # fmt: skip
    assert values_after(plan["carried-bytecode"], "--cache") == ["<WORK>/cache-carried2"]
    assert values_after(plan["carried-bytecode"], "--env") == ["XDG_CACHE_HOME=<WORK>/xdg-carried"]
    switch = {label: dict(v.partition("=")[::2] for v in values_after(plan[label], "--set"))
              .get("trainer.early_cuda_context") for label in warm}  # fmt: skip
    assert list(switch.values()) == ["false", "true", "true", "false"]
    preload = {label: dict(v.partition("=")[::2] for v in values_after(plan[label], "--set"))
               .get("launcher.preload") for label in sweeps}  # fmt: skip
    assert list(preload.values()) == ["false", "true", "true", "false"]
    assert all(values_after(plan[label], "--pairs") == ["2"] for label in sweeps)

    for label in steps:
        argv = plan[label]
        script_at = next(i for i, a in enumerate(argv) if a.endswith("bench_trainer.py"))
        args = bench_trainer.parse_args(argv[script_at + 1 :])
        assert (args.layers, args.seq, args.global_batch, args.micro_batch) == (4, 2048, 32, 8)
        assert args.dtype == ("fp8" if "fp8" in label else "bf16") and not args.eager
        assert ("trainer.fp8_master_weights=true" in args.set) == ("fp8mw" in label)
        assert_composes(bench_trainer.config_overrides(args))


def test_a_carried_compile_cache_makes_the_first_arm_load_it(tmp_path):
    """SEED_CACHE: the first arm keeps the cache copied in (--warm) instead of emptying it."""
    result = script(str(tmp_path / "out"), "--dry-run", PARTS="none", SEED_CACHE=str(tmp_path))
    assert result.returncode == 0, result.stderr
    first = planned(result.stdout)["startup"]
    assert "--warm" in first and values_after(first, "--cache") == ["<WORK>/cache"]


@pytest.mark.slow
def test_the_smoke_run_writes_what_the_device_brings_back(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    # a switch that acts on a CPU: the attention's warm-up (early_cuda_context needs a GPU)
    # PYTHONDONTWRITEBYTECODE: the arms keep their bytecode in a directory of its own, which
    # part 8 carries
    result = script(str(out), "--smoke", WORK=str(work), SWITCH="trainer.warm_attention",
                    PYTHONDONTWRITEBYTECODE="1")  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(len(p.relative_to(out).parts) <= 3 for p in files)
    assert {p.name for p in files} >= {"summary.md", "figures.json", "breakdown.txt",
                                       "logs.tar.gz", "run.log"}  # fmt: skip
    fig = json.loads((out / "figures.json").read_text())
    assert len(fig["arms"]) == 2 and all(a["arm_s"] > a["measured_s"] > 0 for a in fig["arms"])
    ab = fig["switch_ab"]
    assert ab["on"][0]["attention_warm_up"]["error"] is None
    assert ab["off"][0]["attention_warm_up"] is None
    assert ab["compare"]["loss_diff"]["across"] == 0.0  # the switch leaves the numerics
    assert fig["trainer"]["bf16"][0]["tokens_per_s"] > 0
    assert "carried_arm_pool" not in fig  # part 8's pool A/B: hosts of 8 cores or more
    for key in ("carried", "carried_bytecode"):  # part 8: the page cache left alone (--smoke)
        carried = fig[key]
        assert carried["page_cache"] == "kept (--smoke)"
        assert carried["arm_s"] > carried["measured_s"] and carried["main_s"] > 0
    # the first of them compiled its bytecode into an empty directory, the second read a copy
    fresh = work / "xdg-fresh" / "moe_perf" / "pycache"
    assert any(fresh.rglob("*.pyc")) and any((work / "xdg-carried").rglob("*.pyc"))
    pre = fig["preload_ab"]  # one sweep of one pair each way, every arm forked with it on
    assert [len(pre["off"]), len(pre["on"])] == [2, 2]
    assert pre["served"] == {"off": 0, "on": 2, "arms_on": 2}
    assert pre["warm"]["loss_diff"]["across"] == 0.0
    assert pre["warm"]["arm_s"]["on"]["max"] < pre["warm"]["arm_s"]["off"]["min"]
    assert fig["preload_warm"]["arm_s"] == pre["warm"]["arm_s"]["on"]  # the goal's figure
    # part 9: part 5's first sweep compared again, each command once in each condition
    assert values_after(planned(result.stdout)["runner-bytecode"], "--sweep") == [
        str(work / "preload" / "off-1" / "run1")]  # fmt: skip
    walls = fig["runner_bytecode"]
    assert {c: sorted(walls[c]) for c in walls} == {c: ["compare", "dry run"]
                                                    for c in ("kept", "compiled")}  # fmt: skip
    assert all(w["n"] == 1 and w["median"] > 0 for c in walls.values() for w in c.values())
    tag = sys.implementation.cache_tag  # only the kept condition left the runner's bytecode
    kept = work / "runner-bytecode" / "xdg" / "moe_perf" / "pycache"
    assert len(list(kept.rglob(f"moe_perf/report/cli.{tag}.pyc"))) == 1
    assert not (work / "runner-bytecode" / "empty").exists()
    # a copy was compared again (its plot rewritten there), part 5's sweep left as it was
    compared = work / "runner-bytecode" / "sweep" / "comparison.md"
    part5 = work / "preload" / "off-1" / "run1" / "comparison.md"
    assert compared.stat().st_mtime_ns > part5.stat().st_mtime_ns
    page = (out / "summary.md").read_text()
    assert "## Arms (bench_startup.py)" in page and "trainer.warm_attention" in page
    assert "## The runner's own imports (bench_runner_bytecode.py)" in page
    assert "sampled stacks, step 1" in (out / "breakdown.txt").read_text()
    assert fig["skipped"] == ["part 8, carried-arm-pool: not under --smoke (the bytecode pool "
                              "needs 8 cores or more)"]  # fmt: skip
    assert fig["meta"]["mode"] == "--smoke"
