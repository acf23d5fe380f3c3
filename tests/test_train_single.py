"""The trainer end to end: real runs of `python -m moe_perf.trainer` (one process and under
torchrun), their contract lines, exit codes and error messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.trainer_run import run_trainer, write_config

from moe_perf.common import contract
from moe_perf.trainer.train import main

ROOT = Path(__file__).resolve().parents[1]


def check_lines(proc, steps, max_steps: int, world: int) -> None:
    assert proc.returncode == 0, proc.stderr
    assert [s["step"] for s in steps] == list(range(1, max_steps + 1))
    for s in steps:
        assert s["max_steps"] == max_steps
        assert s["step_time_s"] > 0 and s["peak_mem_gib"] > 0
        assert s["tokens_per_s"] == pytest.approx(4 * 64 / s["step_time_s"], rel=1e-3)
        assert s["tflops"] > 0 and s["mfu"] is None  # no peak on CPU
        assert 4 < s["loss"] < 8
    env = [e for e in map(contract.parse_env, proc.stdout.splitlines()) if e]
    assert len(env) == 1 and env[0]["world_size"] == world and env[0]["torch"]


def torchrun(nproc: int, cfg: Path, *overrides: str):
    return run_trainer(
        [
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "localhost:0",
            "-m",
            "moe_perf.trainer",
            str(cfg),
            *overrides,
        ]
    )


@pytest.mark.slow
def test_one_process_equals_torchrun_dp2(tmp_path):
    """Plain `python -m` (no process group, micro-batches of 2) and torchrun with 2 ranks (FSDP
    dp=2, micro-batches of 1), fp32: the same global batch, the same forced routing and the
    same global-batch balance loss, hence the same losses."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    single = write_config(tmp_path / "one", training={"micro_batch": 2})
    proc1, steps1 = run_trainer(["-m", "moe_perf.trainer", str(single)])
    check_lines(proc1, steps1, 3, 1)

    double = write_config(tmp_path / "two", mesh={"nproc_per_node": 2})
    proc2, steps2 = torchrun(2, double)
    check_lines(proc2, steps2, 3, 2)
    for a, b in zip(steps1, steps2, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)


@pytest.mark.slow
def test_torchrun_ep2_bf16_with_overrides(tmp_path):
    """Expert parallel over 2 ranks (all-to-all dispatch) in bf16; overrides on the command."""
    cfg = write_config(tmp_path, mesh={"nproc_per_node": 2, "ep": 2}, dtype={"name": "bf16"})
    proc, steps = torchrun(2, cfg, "training.max_steps=2")
    check_lines(proc, steps, 2, 2)


@pytest.mark.slow
def test_torchrun_pp2_bf16_trains_each_stages_master_weights(tmp_path):
    """Two pipeline stages on one data rank in bf16: each stage computes with bf16 weights over
    fp32 masters (precision.py) under the pipeline schedule's own backward; its losses follow
    the fp32 run's."""
    losses = {}
    for dtype in ("bf16", "fp32"):
        (tmp_path / dtype).mkdir()
        cfg = write_config(
            tmp_path / dtype,
            mesh={"nproc_per_node": 2, "pp": 2},
            dtype={"name": dtype},
            training={"max_steps": 4, "global_batch": 4, "micro_batch": 1},
        )
        proc, steps = torchrun(2, cfg)
        check_lines(proc, steps, 4, 2)
        losses[dtype] = [s["loss"] for s in steps]
    assert len(set(losses["bf16"])) > 1  # it trains
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=5e-3)


def test_missing_corpus_fails_with_the_build_command(tmp_path, capsys):
    cfg = write_config(tmp_path, data={"corpus": "dclm-baseline"})
    assert main([str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "data.corpus=dclm-baseline" in err and "moe_perf.trainer.data build" in err
    assert "Traceback" not in err


def test_mesh_errors_use_the_runners_messages(tmp_path, capsys):
    cfg = write_config(tmp_path, training={"global_batch": 3, "micro_batch": 2})
    assert main([str(cfg)]) == 2
    assert "training.micro_batch=2 must divide global_batch/dp" in capsys.readouterr().err
    cfg = write_config(tmp_path, mesh={"ep": 3})
    assert main([str(cfg)]) == 2
    assert "mesh.ep=3 must divide world/pp" in capsys.readouterr().err
    # under pp: at least pp micro-batches per rank (checked before any process group exists)
    cfg = write_config(
        tmp_path,
        mesh={"nproc_per_node": 4, "pp": 2, "ep": 2},
        training={"global_batch": 8, "micro_batch": 4},
    )
    assert main([str(cfg)]) == 2
    assert (
        "micro-batches per rank >= pp fails: global_batch/(dp*micro_batch) = 8/(2*4) = 1 < "
        "mesh.pp=2" in capsys.readouterr().err
    )


def test_world_size_mismatch_is_refused(tmp_path, capsys):
    cfg = write_config(tmp_path, mesh={"nproc_per_node": 2})
    assert main([str(cfg)]) == 2
    assert (
        "launched with 1 processes but mesh.nnodes * mesh.nproc_per_node = 2"
        in capsys.readouterr().err
    )


def test_fp8_on_cpu_is_a_clear_error(tmp_path, capsys):
    cfg = write_config(tmp_path, dtype={"name": "fp8", "fp8": True})
    assert main([str(cfg)]) == 2
    assert "dtype=fp8 needs a GPU" in capsys.readouterr().err


@pytest.mark.slow
def test_explain_steps_are_profiled_after_the_measured_ones(tmp_path):
    """trainer.explain_steps=2 after 2 measured steps: only the measured steps print contract
    lines; explain/ beside the config holds the Chrome trace (one ProfilerStep#i span per
    profiled step, the experts' scope inside) and the profiled steps' wall times."""
    cfg = write_config(tmp_path, training={"max_steps": 2}, trainer={"explain_steps": 2})
    proc, steps = run_trainer(["-m", "moe_perf.trainer", str(cfg)])
    assert proc.returncode == 0, proc.stderr
    assert [s["step"] for s in steps] == [1, 2]
    info = json.loads((tmp_path / "explain" / "steps.json").read_text())
    assert info["steps"] == 2 and len(info["wall_s"]) == 2 and min(info["wall_s"]) > 0
    trace = json.loads((tmp_path / "explain" / "trace_rank0.json").read_text())
    names = [e.get("name", "") for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert sorted(n for n in names if n.startswith("ProfilerStep#")) == [
        "ProfilerStep#0",
        "ProfilerStep#1",
    ]
    assert "moe_perf.experts" in names
    assert not (tmp_path / "profile").exists()  # profile_steps stays off
