"""Benchmark the reference trainer on one GPU with qwen3-30b-a3b layer shapes.

    python bench/bench_trainer.py                       # H200: 4 layers, seq 2048, bf16
    python bench/bench_trainer.py --profile 1           # + where the GPU time goes
    python bench/bench_trainer.py --eager --global-batch 16 --micro-batch 4
    python bench/bench_trainer.py --model tiny --seq 128 --global-batch 4 --micro-batch 2 \
        --device cpu --eager --steps 4                  # a CPU smoke run

Defaults (docs/benchmarks/reference-trainer-step-h200-2026-12.md): 4 of qwen3-30b-a3b's 48
layers (fits one H200 with fp32 AdamW state), global batch 32 x 2048 tokens in micro-batches of
16, blocks and loss compiled.

Composes the run's config from conf/ with Hydra's compose API, as the runner composes an arm's
(the model's preset with the layer count cut, mesh=single, forced balance on), writes it
resolved into --out, runs the real trainer on it (`torchrun --nproc-per-node 1 -m
moe_perf.trainer`, or plain `python -m` with --launcher python: no process group, no FSDP)
through the runner's launch code, and prints tokens/s, TFLOP/s, MFU and peak memory: the
runner's summary of the steps before the profiled ones (step 1 dropped, medians, peak memory
the maximum). FLOP formula: moe_perf/trainer/flops.py (causal attention half).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import profile_summary  # noqa: E402  (bench/)

from moe_perf.launchers.process import run_trainer  # noqa: E402
from moe_perf.report.record import summarize  # noqa: E402
from moe_perf.runner import schema  # noqa: E402

TIMEOUT_S = 4 * 3600.0  # the trainer is stopped past this (SIGTERM, SIGKILL 30 s later)


def config_overrides(args) -> list[str]:
    """The command-line options as overrides of conf/config.yaml; --set ones last (they win)."""
    overrides = [
        f"model={args.model}",
        "mesh=single",
        f"dtype={args.dtype}",
        f"trainer.compile={str(not args.eager).lower()}",
        f"training.sequence_length={args.seq}",
        f"training.global_batch={args.global_batch}",
        f"training.micro_batch={args.micro_batch}",
        f"training.max_steps={args.steps + args.profile}",  # profiled steps come last
        f"training.device={args.device}",
        f"data.root={ROOT / 'workspace' / 'datasets'}",
    ]
    if args.layers:
        overrides.append(f"model.num_layers={args.layers}")
    return [*overrides, *args.set]


def trainer_config(overrides: list[str]) -> dict:
    """conf/config.yaml composed with `overrides` and resolved: the file the trainer reads (no
    `hydra` section). A cut layer count keeps at most that many leading dense layers."""
    schema.register()  # the typed schema and the resolvers conf/ uses
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        config = OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)
    model = config["model"]
    model["dense_layers"] = min(model["dense_layers"], model["num_layers"])
    return config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
        help="extra overrides of conf/config.yaml (as `python -m moe_perf` takes them)",
    )
    p.add_argument("--out", default=str(ROOT / "outputs" / "bench"))
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="torch.profiler over the last N steps; kernel summary in OUT/profile/",
    )
    args = p.parse_args(argv)
    if args.profile:
        args.set += [
            f"trainer.profile_steps={args.profile}",
            f"trainer.profile_dir={Path(args.out) / 'profile'}",
        ]
    return args


def launch_argv(launcher: str, cfg_path: Path) -> list[str]:
    torchrun = [
        "-m", "torch.distributed.run", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
    ]  # fmt: skip
    return [sys.executable, *(torchrun if launcher == "torchrun" else []), "-m",
            "moe_perf.trainer", str(cfg_path)]  # fmt: skip


def print_summary(args: argparse.Namespace, summary: dict, out: Path) -> None:
    mfu = "n/a" if summary["mfu"] is None else f"{summary['mfu']:.3f}"
    print(
        f"\nbench: {args.model} x{args.layers} layers, seq {args.seq}, {args.dtype}, "
        f"global batch {args.global_batch} (micro {args.micro_batch}), "
        f"median of {summary['steps_measured']} steps"
    )
    print(f"  tokens/s      {summary['tokens_per_s']:.1f}")
    print(f"  TFLOP/s/GPU   {summary['tflops']:.2f}")
    print(f"  MFU           {mfu}")
    print(f"  peak mem GiB  {summary['peak_mem_gib']:.2f}")
    print(f"  step time s   {summary['step_time_s']:.4f}")
    environment = summary["environment"]
    if environment:
        print(f"  torch {environment.get('torch')}, devices {environment.get('devices')}")
    print(f"  -> {out / 'bench.json'}")


def write_profile_summary(trace: Path, steps: int) -> None:
    prof = profile_summary.summarize(trace, steps)
    (trace.parent / "summary.json").write_text(json.dumps(prof, indent=1) + "\n")
    md = profile_summary.to_markdown(prof)
    (trace.parent / "summary.md").write_text(md + "\n")
    print("\n" + md)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(trainer_config(config_overrides(args)), sort_keys=False))
    cmd = launch_argv(args.launcher, cfg_path)
    print("+", " ".join(cmd), flush=True)
    max_steps = args.steps + args.profile
    # the runner's launch: output to OUT/console.log and the console, this checkout first on
    # PYTHONPATH, every process stopped at Ctrl-C or past the timeout
    result = run_trainer(cmd, cwd=ROOT, arm_dir=out, label="bench", timeout_s=TIMEOUT_S,
                         kill_grace_s=30, max_steps=max_steps)  # fmt: skip
    if result.failure or len(result.steps) < 2:
        failure = result.failure or f"{len(result.steps)} steps"
        print(f"bench: trainer failed: {failure} (log: {out / 'console.log'})", file=sys.stderr)
        return result.exit_code or 1

    # profiled steps (tracing overhead) left out; the summary drops step 1 (warm-up, compile)
    steps = sorted(result.steps, key=lambda s: s["step"])
    timed = steps[: len(steps) - args.profile] if len(steps) - args.profile >= 2 else steps
    summary = {
        "model": args.model,
        "layers": args.layers,
        "seq": args.seq,
        "global_batch": args.global_batch,
        "micro_batch": args.micro_batch,
        "dtype": args.dtype,
        "compile": not args.eager,
        **summarize(timed),
        "wall_s": round(result.trainer_wall_s, 1),
        "command": " ".join(cmd),
        "environment": result.trainer_env,
    }
    (out / "bench.json").write_text(json.dumps(summary, indent=1) + "\n")
    print_summary(args, summary, out)
    trace = out / "profile" / "trace_rank0.json"
    if args.profile and trace.is_file():
        write_profile_summary(trace, args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
