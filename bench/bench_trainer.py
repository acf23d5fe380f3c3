"""Benchmark the reference trainer on one GPU with qwen3-30b-a3b layer shapes.

    python bench/bench_trainer.py                       # H200: 4 layers, seq 2048, bf16
    python bench/bench_trainer.py --profile 1           # + where the GPU time goes
    python bench/bench_trainer.py --eager --global-batch 16 --micro-batch 4
    python bench/bench_trainer.py --model tiny --seq 128 --global-batch 4 --micro-batch 2 \
        --device cpu --eager --steps 4                  # a CPU smoke run

Defaults (docs/benchmarks.md): 4 of qwen3-30b-a3b's 48 layers (fits one H200 with fp32 AdamW
state), global batch 32 x 2048 tokens in micro-batches of 16, blocks and loss compiled.

Writes a resolved config (the model's conf/model/*.yaml with the layer count cut, forced
balance on) into --out, runs the real trainer on it (`torchrun --nproc-per-node 1 -m
moe_perf.trainer`, or plain `python -m` with --launcher python: no process group, no FSDP),
and prints tokens/s, TFLOP/s, MFU and peak memory: medians over the steps after the first
(peak memory: the maximum). FLOP formula: moe_perf/trainer/flops.py (causal attention half).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from moe_perf.common import contract  # noqa: E402


def make_config(args) -> dict:
    model = yaml.safe_load((ROOT / "conf" / "model" / f"{args.model}.yaml").read_text())
    if args.layers:
        model["num_layers"] = args.layers
        model["dense_layers"] = min(model.get("dense_layers", 0), args.layers)
    trainer = yaml.safe_load((ROOT / "conf" / "trainer" / "reference.yaml").read_text())
    trainer["compile"] = not args.eager
    return {
        "model": model,
        "mesh": {"nnodes": 1, "nproc_per_node": 1, "pp": 1, "cp": 1, "ep": 1},
        "dtype": {"name": args.dtype, "fp8": args.dtype == "fp8"},
        "training": {
            "sequence_length": args.seq,
            "global_batch": args.global_batch,
            "micro_batch": args.micro_batch,
            "max_steps": args.steps + args.profile,  # profiled steps come last
            "benchmark": True,
            "seed": 1234,
            "lr": 3e-4,
            "device": args.device,
        },
        "data": {"corpus": None, "root": str(ROOT / "workspace" / "datasets")},
        "trainer": trainer,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=4, help="cut the layer count to fit one GPU")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--eager", action="store_true", help="trainer.compile=false")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp8", "fp32"])
    p.add_argument("--device", default="auto")
    p.add_argument("--launcher", default="torchrun", choices=["torchrun", "python"])
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="extra config overrides passed to the trainer",
    )
    p.add_argument("--out", default=str(ROOT / "outputs" / "bench"))
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="torch.profiler over the last N steps; kernel summary in OUT/profile/",
    )
    args = p.parse_args()
    if args.profile:
        args.set += [
            f"trainer.profile_steps={args.profile}",
            f"trainer.profile_dir={Path(args.out) / 'profile'}",
        ]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(make_config(args), sort_keys=False))
    launch = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "localhost:0",
        ]
        if args.launcher == "torchrun"
        else [sys.executable]
    )
    cmd = [*launch, "-m", "moe_perf.trainer", str(cfg_path), *args.set]
    print("+", " ".join(cmd), flush=True)

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    steps, environment = [], None
    for line in proc.stdout:
        print(line, end="", flush=True)
        if (s := contract.parse_step(line)) is not None:
            steps.append(s)
        elif (e := contract.parse_env(line)) is not None:
            environment = e
    rc = proc.wait()
    wall = time.perf_counter() - t0
    if rc != 0 or len(steps) < 2:
        print(f"bench: trainer failed (exit {rc}, {len(steps)} steps)", file=sys.stderr)
        return rc or 1

    # step 1 (allocator warm-up, compile) dropped, and profiled steps (tracing overhead)
    measured = steps[1 : len(steps) - args.profile] or steps[1:]

    def med(key):
        vals = [s[key] for s in measured if s.get(key) is not None]
        return statistics.median(vals) if vals else None

    summary = {
        "model": args.model,
        "layers": args.layers,
        "seq": args.seq,
        "global_batch": args.global_batch,
        "micro_batch": args.micro_batch,
        "dtype": args.dtype,
        "compile": not args.eager,
        "steps_measured": len(measured),
        "step_time_s": med("step_time_s"),
        "tokens_per_s": med("tokens_per_s"),
        "tflops": med("tflops"),
        "mfu": med("mfu"),
        "peak_mem_gib": max(s["peak_mem_gib"] for s in steps),
        "wall_s": round(wall, 1),
        "command": " ".join(cmd),
        "environment": environment,
    }
    (out / "bench.json").write_text(json.dumps(summary, indent=1) + "\n")
    mfu = "n/a" if summary["mfu"] is None else f"{summary['mfu']:.3f}"
    print(
        f"\nbench: {args.model} x{args.layers} layers, seq {args.seq}, {args.dtype}, "
        f"global batch {args.global_batch} (micro {args.micro_batch}), "
        f"median of {len(measured)} steps"
    )
    print(f"  tokens/s      {summary['tokens_per_s']:.1f}")
    print(f"  TFLOP/s/GPU   {summary['tflops']:.2f}")
    print(f"  MFU           {mfu}")
    print(f"  peak mem GiB  {summary['peak_mem_gib']:.2f}")
    print(f"  step time s   {summary['step_time_s']:.4f}")
    if environment:
        print(f"  torch {environment.get('torch')}, devices {environment.get('devices')}")
    print(f"  -> {out / 'bench.json'}")
    trace = out / "profile" / "trace_rank0.json"
    if args.profile and trace.is_file():
        import profile_summary

        prof = profile_summary.summarize(trace, args.profile)
        (out / "profile" / "summary.json").write_text(json.dumps(prof, indent=1) + "\n")
        md = profile_summary.to_markdown(prof)
        (out / "profile" / "summary.md").write_text(md + "\n")
        print("\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
