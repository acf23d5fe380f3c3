"""Where a profiled training step's time goes, from one Chrome trace (or an arm's explain/).

    python bench/profile_summary.py outputs/bench/profile/trace_rank0.json --steps 2
    python bench/profile_summary.py <arm dir>/explain/trace_rank0.json

The trainer writes traces with `trainer.profile_steps=N` (bench_trainer.py --profile N) or
`explain=true` (`<arm dir>/explain/`, one ProfilerStep#i span per step). The categories and
their rules are the comparison's own (moe_perf/report/explain/): on GPU the device kernels,
attributed through their launching CPU op, plus the GPU's idle time in the step; on CPU the
ops' self time plus the time outside any op. `--steps` divides a trace without step markers.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from moe_perf.report.explain.categories import CATEGORIES
from moe_perf.report.explain.traces import read_trace, trace_breakdown


def summarize(trace_path: Path, steps: int | None = None, top: int = 15) -> dict:
    """Median ms per step by category and by op/kernel name (names carry their category)."""
    b = trace_breakdown(read_trace(trace_path), steps)
    step_ms = statistics.median(b["step_ms"]) if b["step_ms"] else 0.0
    cats = {k: statistics.median(v) for k, v in b["categories"].items() if v and any(v)}
    names = {n: statistics.median(v) for n, v in b["names"].items()}
    return {
        "device": b["device"],
        "steps": b["steps"],
        "step_markers": b["step_markers"],
        "step_ms": step_ms,
        "categories": {
            label: {"ms_per_step": cats[key], "share": cats[key] / step_ms if step_ms else None}
            for key, label in CATEGORIES
            if key in cats
        },
        "top": [
            {"name": n, "ms_per_step": t}
            for n, t in sorted(names.items(), key=lambda kv: -kv[1])[:top]
        ],
    }


def to_markdown(s: dict) -> str:
    unit = "GPU kernels" if s["device"] == "cuda" else "CPU ops (self time)"
    how = "median of steps" if s["step_markers"] else "the trace's mean over its steps"
    lines = [
        f"{s['steps']} profiled step(s) on {s['device']}, {unit}; {s['step_ms']:.2f} ms per "
        f"step ({how})",
        "",
        "| category | ms/step | share of the step |",
        "|---|---:|---:|",
    ]
    for label, v in s["categories"].items():
        share = "-" if v["share"] is None else f"{100 * v['share']:.1f}%"
        lines.append(f"| {label} | {v['ms_per_step']:.2f} | {share} |")
    lines += ["", "| top op or kernel [category] | ms/step |", "|---|---:|"]
    for k in s["top"]:
        name = k["name"].replace("|", "\\|")
        lines.append(f"| `{name}` | {k['ms_per_step']:.3f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--steps", type=int, default=None, help="steps a trace without markers covers")
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
