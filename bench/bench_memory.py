"""The memory pre-flight's estimate against the reference trainer's measured peak, per config.

    python bench/bench_memory.py                 # one H200: the bench configs below (~4-5 min)
    python bench/bench_memory.py --cpu           # this machine: tiny configs, eager, fp32
    python bench/bench_memory.py --only qwen3-30b-a3b-4L-32x16 --steps 3
    python bench/bench_memory.py --cpu --set mesh.device_memory_gib=0.5   # refused, still run

Each config is composed from conf/ as `python -m moe_perf` composes an arm (mesh=single,
forced balance), then: the estimate (moe_perf/common/memory.py) and whether the pre-flight
(runner/preflight.check_memory, against this host's device) refuses it; then the real trainer
runs it in a process of its own under `torchrun --nproc-per-node 1`, which reports its peak:
torch.cuda.max_memory_allocated and max_memory_reserved on a GPU, its own peak RSS (VmHWM) on a
CPU. A refused config still runs, to show the refusal was right (it should run out of memory).
Prints a table and writes OUT/bench_memory.json (one record per config).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moe_perf.common import memory  # noqa: E402
from moe_perf.common.config import config_from_dict  # noqa: E402
from moe_perf.common.errors import PrerequisiteError  # noqa: E402
from moe_perf.common.peak_rss import peak_rss_bytes  # noqa: E402

GIB = 2**30
# (name, model, layers, global batch, micro-batch, more overrides): the H200 data points of
# docs/benchmarks/memory-estimate-h200-2026-12.md, and every preset at 4 layers (gpt-oss-120b
# ran out of memory there)
GPU_CONFIGS = [
    ("qwen3-30b-a3b-4L-32x16", "qwen3-30b-a3b", 4, 32, 16, []),
    ("qwen3-30b-a3b-8L-32x8", "qwen3-30b-a3b", 8, 32, 8, []),
    *[
        (f"{m}-4L-16x8", m, 4, 16, 8, [])
        for m in (
            "qwen3-30b-a3b",
            "qwen3.5-35b-a3b",
            "deepseek-v2-lite",
            "gpt-oss-20b",
            "gpt-oss-120b",
        )  # fmt: skip
    ],
]
# tests/test_memory.py's two CPU cases: activations and logits dominate, then weights
CPU_CONFIGS = [
    ("tiny-activations", "tiny", 2, 8, 8,
     ["model.vocab_size=8192", "model.hidden=128", "model.top_k=4", "model.expert_ffn=256",
      "model.head_dim=32", "training.sequence_length=512"]),
    ("tiny-weights", "tiny", 2, 2, 1,
     ["model.vocab_size=2048", "model.hidden=256", "model.num_experts=64",
      "model.expert_ffn=512", "model.head_dim=64", "training.sequence_length=64"]),
]  # fmt: skip


def overrides(cpu: bool, model, layers, global_batch, micro_batch, extra, steps) -> list[str]:
    """The run as overrides of conf/config.yaml."""
    common = [
        f"model={model}",
        "mesh=single",
        f"model.num_layers={layers}",
        f"training.global_batch={global_batch}",
        f"training.micro_batch={micro_batch}",
        f"training.max_steps={steps}",
        "routing=balanced",
    ]
    if cpu:
        return [*common, "dtype=fp32", "trainer.compile=false", "training.device=cpu", *extra]
    return [*common, "dtype=bf16", "trainer.compile=true", "training.sequence_length=2048",
            "training.device=cuda", *extra]  # fmt: skip


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from moe_perf.runner import schema

    schema.register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose("config", overrides=overrides)
    # a cut layer count keeps at most that many leading dense layers (as bench_trainer does)
    cfg.model.dense_layers = min(int(cfg.model.dense_layers), int(cfg.model.num_layers))
    return cfg


def preflight(cfg) -> dict:
    """The estimate, the device it is checked against and the pre-flight's verdict."""
    from omegaconf import OmegaConf

    from moe_perf.runner import preflight

    sections = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in preflight.TRAINER_SECTIONS}
    known = preflight.device_memory(cfg)
    device = known[0] if known else ("cpu" if cfg.training.device == "cpu" else "cuda")
    est = memory.estimate(config_from_dict(sections), device)
    try:
        preflight.check_memory(cfg)
        refusal = None
    except PrerequisiteError as err:
        refusal = str(err)
    parts = ("weights", "gradients", "optimizer", "activations", "logits", "runtime")
    return {
        "sections": sections,
        "estimate_gib": est.gib(),
        "estimate_tensors_gib": est.tensors / GIB,
        "estimate_parts_gib": {p: getattr(est, p) / GIB for p in parts},
        "device": device,
        "capacity_gib": known[1] if known else None,
        "capacity_source": known[2] if known else None,
        "refused": refusal is not None,
        "refusal": refusal,
    }


def measure(config_path: Path, peak_path: Path, timeout_s: float) -> dict:
    """Run the trainer on `config_path` in its own torchrun process; its peaks and outcome."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
              "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]  # fmt: skip
    cmd = [*launch, str(Path(__file__).resolve()), "--child", str(config_path), str(peak_path)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout_s)  # fmt: skip
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as err:
        rc, tail = None, f"timed out after {timeout_s:.0f} s: {err}"
    wall = time.perf_counter() - t0
    result = json.loads(peak_path.read_text()) if peak_path.is_file() else {"outcome": "failed"}
    result.update(exit_code=rc, wall_s=round(wall, 1))
    if result["outcome"] != "ok":
        result["log_tail"] = tail
    return result


def child(config_path: str, peak_path: str) -> int:
    """In the torchrun worker: the real training loop, then this process's peaks as JSON."""
    import torch

    from moe_perf.common.config import load_config
    from moe_perf.trainer import train

    cfg = load_config(config_path)
    outcome, error = "ok", None
    try:
        train.run(cfg)
    except torch.OutOfMemoryError as err:
        outcome, error = "out of memory", str(err).splitlines()[0]
    except Exception as err:  # recorded, not raised: the peaks so far are still worth reading
        outcome, error = "failed", f"{type(err).__name__}: {err}"
    if torch.cuda.is_available() and cfg.training.device != "cpu":
        peaks = {
            "allocated_gib": torch.cuda.max_memory_allocated() / GIB,
            "reserved_gib": torch.cuda.max_memory_reserved() / GIB,
        }
    else:  # this process's own peak, not ru_maxrss (it holds the launcher's)
        peaks = {"rss_gib": peak_rss_bytes() / GIB}
    Path(peak_path).write_text(json.dumps({"outcome": outcome, "error": error, **peaks}) + "\n")
    return 0 if outcome == "ok" else 1


def row(rec: dict) -> str:
    """GPU: the estimated tensors against max allocated; CPU: the whole estimate against the
    max RSS (which holds the process's runtime too)."""
    m = rec["measured"]
    if "rss_gib" in m:
        measured, estimated = m["rss_gib"], rec["estimate_gib"]
    else:
        measured, estimated = m.get("allocated_gib"), rec["estimate_tensors_gib"]
    cells = [f"{estimated:8.2f}"]
    for value in (measured, m.get("reserved_gib")):
        cells.append(f"{value:8.2f}" if value is not None else f"{'-':>8}")
    ok = measured and m["outcome"] == "ok"  # a failed run's peak is not the run's
    cells.append(f"{estimated / measured:6.2f}" if ok else f"{'-':>6}")
    verdict = "refused" if rec["refused"] else "runs"
    return f"{rec['name']:26} {' '.join(cells)}  {verdict:9} {m['outcome']}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="tiny configs on this machine's CPU")
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these configs")
    p.add_argument("--steps", type=int, default=3, help="steps per run (AdamW state from step 2)")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="another override of conf/config.yaml for every config")  # fmt: skip
    p.add_argument("--out", default=str(ROOT / "outputs" / "bench_memory"))
    p.add_argument("--child", nargs=2, metavar=("CONFIG", "PEAK_JSON"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(*args.child)

    configs = CPU_CONFIGS if args.cpu else GPU_CONFIGS
    if args.only:
        configs = [c for c in configs if c[0] in args.only]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    print(
        "GiB per rank; GPU: estimated tensors vs max allocated (and reserved); CPU: the "
        "whole estimate vs max RSS"
    )
    print(f"{'config':26} {'estimate':>8} {'measured':>8} {'reserved':>8} {'ratio':>6}  "
          f"{'preflight':9} outcome")  # fmt: skip
    for name, *run in configs:
        run_dir = out / name
        run_dir.mkdir(exist_ok=True)
        cfg = compose([*overrides(args.cpu, *run, args.steps), *args.set])
        rec = {"name": name, **preflight(cfg)}
        config_path = run_dir / "config.yaml"
        config_path.write_text(yaml.safe_dump(rec.pop("sections"), sort_keys=False))
        peak_path = run_dir / "peak.json"
        peak_path.unlink(missing_ok=True)
        rec["measured"] = measure(config_path, peak_path, args.timeout)
        records.append(rec)
        print(row(rec), flush=True)
        if rec["refused"]:
            print(f"    preflight: {rec['refusal']}", flush=True)
        if rec["measured"]["outcome"] != "ok" and rec["measured"].get("error"):
            print(f"    {rec['measured']['error']}", flush=True)
    (out / "bench_memory.json").write_text(json.dumps(records, indent=1) + "\n")
    print(f"-> {out / 'bench_memory.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
