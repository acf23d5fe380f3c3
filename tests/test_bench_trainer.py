"""bench/bench_trainer.py, bench_trainer_ab.sh, bench_dispatch.py, profile_summary.py and
trace_ops.py on CPU: the real trainer, a real profile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import profile_summary  # noqa: E402
import trace_ops  # noqa: E402


@pytest.mark.slow
def test_bench_trainer_cpu_with_profile(tmp_path):
    out = tmp_path / "bench"
    cmd = [
        sys.executable, str(ROOT / "bench" / "bench_trainer.py"),
        "--model", "tiny", "--seq", "64", "--global-batch", "4", "--micro-batch", "2",
        "--device", "cpu", "--eager", "--steps", "3", "--profile", "1", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((out / "bench.json").read_text())
    # 3 timed steps + 1 profiled: step 1 and the profiled step are left out of the medians.
    assert summary["steps_measured"] == 2
    assert summary["tokens_per_s"] > 0 and summary["tflops"] > 0
    assert summary["mfu"] is None  # no peak on CPU
    assert summary["compile"] is False
    config = (out / "config.yaml").read_text()
    assert "max_steps: 4" in config and "mode: balanced" in config  # forced balance
    table = (out / "profile" / "kernels_rank0.txt").read_text()
    assert "aten::" in table
    assert (out / "profile" / "trace_rank0.json").is_file()
    # the profiled step is marked, so its summary covers that step and nothing else: its
    # categories add up to it (on CPU, ops' self time plus the Python between them)
    prof = json.loads((out / "profile" / "summary.json").read_text())
    assert prof["step_markers"] and prof["steps"] == 1
    total = sum(c["ms_per_step"] for c in prof["categories"].values())
    assert total == pytest.approx(prof["step_ms"], rel=0.01)


def _kernel(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_profile_summary_categories_and_idle(tmp_path):
    trace = {
        "traceEvents": [
            _kernel("nvjet_sm90_tst_256x128_gemm", 0, 600),
            _kernel("ncclDevKernel_AllToAll", 500, 200),  # overlaps the GEMM by 100 us
            _kernel("triton_poi_fused_mul_0", 1000, 100),
            _kernel("void at::native::multi_tensor_apply_kernel<Adam>", 1200, 100),
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},
        ]
    }
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    s = profile_summary.summarize(path, steps=2)
    cats = s["categories"]
    assert cats["dense GEMM"]["ms_per_step"] == pytest.approx(0.3)
    assert cats["all-to-all"]["ms_per_step"] == pytest.approx(0.1)
    assert cats["norms/elementwise"]["ms_per_step"] == pytest.approx(0.05)  # triton fused
    assert cats["optimizer"]["ms_per_step"] == pytest.approx(0.05)
    # no step markers: the step is the CPU op's 5000 us span over 2 steps; the GPU is busy
    # [0, 700] + [1000, 1100] + [1200, 1300] = 900 us of it, idle the rest
    assert s["step_ms"] == pytest.approx(2.5)
    assert cats["host gaps/idle"]["ms_per_step"] == pytest.approx(4.1 / 2)
    assert set(cats) == {"dense GEMM", "all-to-all", "norms/elementwise", "optimizer",
                         "host gaps/idle"}  # fmt: skip
    assert "| dense GEMM | 0.30 | 12.0% |" in profile_summary.to_markdown(s)


def test_trace_ops_finds_each_call_and_what_nests_in_it(tmp_path):
    import torch

    x, w = torch.randn(64, 32), torch.randn(16, 32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for step in range(2):
            with torch.profiler.record_function(f"ProfilerStep#{step}"):
                for _ in range(step + 1):  # one call in step 0, two in step 1
                    torch.nn.functional.linear(x, w)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    trace = trace_ops.read_trace(path)

    every = trace_ops.inside(trace, "aten::linear")
    assert len(every) == 3
    second = trace_ops.inside(trace, "aten::linear", step=1)
    assert [c["ts_ms"] for c in second] == [c["ts_ms"] for c in every[1:]]
    for call in every:
        assert call["name"] == "aten::linear"
        assert "aten::matmul [cpu_op]" in call["nested"]  # linear = t + matmul on CPU
        assert sum(ms for _, ms in call["nested"].values()) <= call["ms"] + 1e-3
        assert call["runtime"] == {}  # no CUDA on this trace
    with pytest.raises(SystemExit, match="no ProfilerStep#5"):
        trace_ops.inside(trace, "aten::linear", step=5)

    assert trace_ops.main([str(path), "aten::linear", "--step", "0"]) == 0
    assert trace_ops.main([str(path), "no_such_op"]) == 1


def test_trace_ops_counts_cuda_calls_at_any_depth_and_children_once():
    def ev(name, cat, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 7}

    trace = {
        "traceEvents": [
            ev("aten::_scaled_dot_product_cudnn_attention", "cpu_op", 0, 1000),
            ev("aten::empty", "cpu_op", 10, 300),
            ev("cudaMalloc", "cuda_runtime", 20, 250),  # inside aten::empty
            ev("cudaLaunchKernel", "cuda_runtime", 400, 5),
            ev("cuModuleLoadData", "cuda_driver", 500, 400),
            ev("aten::mm", "cpu_op", 2000, 50),  # after the call: not part of it
            {**ev("cudaMalloc", "cuda_runtime", 30, 100), "tid": 8},  # another thread
        ]
    }
    (call,) = trace_ops.inside(trace, "cudnn_attention")
    assert call["ms"] == pytest.approx(1.0)
    assert call["nested"] == {
        "aten::empty [cpu_op]": [1, pytest.approx(0.3)],
        "cudaLaunchKernel [cuda_runtime]": [1, pytest.approx(0.005)],
        "cuModuleLoadData [cuda_driver]": [1, pytest.approx(0.4)],
    }
    assert call["runtime"] == {
        "cudaMalloc [cuda_runtime]": [1, pytest.approx(0.25)],
        "cudaLaunchKernel [cuda_runtime]": [1, pytest.approx(0.005)],
        "cuModuleLoadData [cuda_driver]": [1, pytest.approx(0.4)],
    }
    # a step is the host's span, not the same step's annotation on the GPU (which runs later)
    trace["traceEvents"] += [
        ev("ProfilerStep#0", "user_annotation", 0, 1500),
        ev("ProfilerStep#0", "gpu_user_annotation", 100, 5000),
        ev("aten::_scaled_dot_product_cudnn_attention", "cpu_op", 3000, 10),  # step 1's
    ]
    assert [c["ts_ms"] for c in trace_ops.inside(trace, "cudnn_attention", step=0)] == [0.0]


@pytest.mark.slow
def test_bench_dispatch_checks_both_dispatches_agree_and_times_them():
    """bench/bench_dispatch.py on CPU, small and eager: both variants' results are checked
    equal before anything is timed, then each gets its median."""
    cmd = [
        sys.executable, str(ROOT / "bench" / "bench_dispatch.py"), "--tokens", "256",
        "--hidden", "32", "--experts", "16", "--top-k", "4", "--dtype", "fp32",
        "--device", "cpu", "--eager", "--warmup", "1", "--repeats", "3",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert "T=256 D=32 E=16 K=4 fp32 eager on cpu" in lines[0]
    times = {line.split()[0]: float(line.split()[1]) for line in lines[1:3]}
    assert set(times) == {"sort", "round_robin"} and all(t > 0 for t in times.values())
    assert lines[3].split()[0] == "saved"


@pytest.mark.slow
def test_bench_trainer_ab_runs_a_base_commit_and_this_tree(tmp_path):
    """bench/bench_trainer_ab.sh on CPU with this checkout's HEAD as the base: both variants
    run the real trainer and land in summary.txt."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True)
    if head.returncode:
        pytest.skip("not a git checkout")
    configs = ("--model tiny --layers 1 --seq 64 --global-batch 2 --micro-batch 2 --device cpu "
               "--eager --steps 2 --dtype fp32 --launcher python")  # fmt: skip
    env = {**os.environ, "PYTHON": sys.executable, "CONFIGS": configs, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "bench_trainer_ab.sh"), "HEAD",
                           str(tmp_path / "ab")], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = (tmp_path / "ab" / "summary.txt").read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["c1-base", "c1-this"]
    for name in ("c1-base", "c1-this"):
        bench = json.loads((tmp_path / "ab" / name / "bench.json").read_text())
        assert bench["steps_measured"] >= 1 and bench["tokens_per_s"] > 0
        assert (tmp_path / "ab" / name / "profile" / "summary.md").is_file()
