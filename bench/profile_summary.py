"""Where a profiled training step's GPU time goes, from the trainer's Chrome trace.

    python bench/profile_summary.py outputs/bench/profile/trace_rank0.json --steps 2

The trainer writes the trace with `trainer.profile_steps=N` (bench_trainer.py --profile N).
This reads the GPU kernels of the trace, groups them by category (name patterns below), and
prints per step: milliseconds and share of GPU busy time per category, the top kernels, and
how much of the profiled span the GPU sat idle (idle = host-bound: launches, syncs, Python).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

# First match wins; patterns are searched in the lower-cased kernel name.
CATEGORIES = (
    ("communication (NCCL)", r"nccl"),
    ("attention (flash/cuDNN)", r"flash|fmha|attention|sdpa|cudnn"),
    ("optimizer (foreach/Adam)", r"multi_tensor_apply|foreach|adam"),
    ("routing: sort/scan/scatter/gather", r"sort|radix|scan|scatter|gather|index|cumsum|topk"),
    ("GEMM (dense and grouped)", r"gemm|cutlass|xmma|nvjet|cublas|sm90_|sm100_|wgmma|matmul"),
    ("compiled fused (triton)", r"triton"),
    ("copies/casts/memset", r"memcpy|memset|copy|cast|fill"),
    ("elementwise/reductions/norms", r"elementwise|vectorized|reduce|softmax|norm|unrolled"),
)


def categorize(name: str) -> str:
    low = name.lower()
    for label, pattern in CATEGORIES:
        if re.search(pattern, low):
            return label
    return "other"


def gpu_kernels(trace: dict) -> list[dict]:
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]


def busy_time(kernels: list[dict]) -> tuple[float, float]:
    """(union of kernel intervals, span first start to last end), microseconds."""
    spans = sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels)
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy, (spans[-1][1] - spans[0][0]) if spans else 0.0


def summarize(trace_path: Path, steps: int, top: int = 15) -> dict:
    kernels = gpu_kernels(json.loads(trace_path.read_text()))
    by_cat: dict[str, float] = defaultdict(float)
    by_name: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for k in kernels:
        by_cat[categorize(k["name"])] += k["dur"]
        by_name[k["name"]][0] += k["dur"]
        by_name[k["name"]][1] += 1
    total = sum(by_cat.values())
    busy, span = busy_time(kernels)
    return {
        "steps": steps,
        "kernel_ms_per_step": total / 1e3 / steps,
        "busy_ms_per_step": busy / 1e3 / steps,
        "span_ms_per_step": span / 1e3 / steps,
        "idle_fraction": 1 - busy / span if span else None,
        "categories": {
            c: {"ms_per_step": t / 1e3 / steps, "share": t / total}
            for c, t in sorted(by_cat.items(), key=lambda kv: -kv[1])
        },
        "top_kernels": [
            {"name": n[:140], "ms_per_step": t / 1e3 / steps, "calls_per_step": c / steps}
            for n, (t, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
        ],
    }


def to_markdown(s: dict) -> str:
    lines = [
        f"GPU busy {s['busy_ms_per_step']:.1f} ms of a {s['span_ms_per_step']:.1f} ms span per "
        f"step (idle {100 * (s['idle_fraction'] or 0):.1f}%)",
        "",
        "| category | ms/step | share of kernel time |",
        "|---|---:|---:|",
    ]
    for c, v in s["categories"].items():
        lines.append(f"| {c} | {v['ms_per_step']:.1f} | {100 * v['share']:.1f}% |")
    lines += ["", "| top kernel | ms/step | calls/step |", "|---|---:|---:|"]
    for k in s["top_kernels"]:
        name = k["name"].replace("|", "\\|")
        lines.append(f"| `{name}` | {k['ms_per_step']:.2f} | {k['calls_per_step']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--steps", type=int, default=1, help="steps the trace covers")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--json", type=Path, help="also write the summary here")
    args = p.parse_args()
    s = summarize(args.trace, args.steps, args.top)
    print(to_markdown(s))
    if args.json:
        args.json.write_text(json.dumps(s, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
