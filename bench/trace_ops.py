"""What happens inside one op's calls, from a Chrome trace: for every call of the ops whose name
holds PATTERN, its host time and the events nested in it on its thread (CUDA runtime and driver
calls, child ops), summed by name.

    python bench/trace_ops.py TRACE PATTERN [--step N] [--top 12]

Made to see what a first call spends (cuDNN's attention in step 1: building its plan, loading
modules, waiting on the device), with a trace of the steps that include it:
`trainer.profile_steps=8` over an 8-step arm profiles step 1 too. `--step N` keeps the calls
inside the trace's `ProfilerStep#N` span (the profiled steps count from 0). Times in ms.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_perf.report.explain.traces import TraceOp, nest_ops, read_trace  # noqa: E402


def _step_window(spans: list[dict], step: int) -> tuple[float, float] | None:
    # the host's span (a GPU trace also has the step's `gpu_user_annotation`, later on the GPU)
    marks = [e for e in spans if e.get("name") == f"ProfilerStep#{step}"
             and e.get("cat") == "user_annotation"]  # fmt: skip
    if not marks:
        return None
    return min(e["ts"] for e in marks), max(e["ts"] + e["dur"] for e in marks)


def _add(table: dict[str, list], op: TraceOp) -> None:
    slot = table.setdefault(f"{op.name} [{op.cat}]", [0, 0.0])
    slot[0] += 1
    slot[1] += (op.end - op.ts) / 1000


def inside(trace: dict, pattern: str, step: int | None = None) -> list[dict]:
    """Each call of an op whose name holds `pattern` (in trace order), with what nests in it on
    its thread: {"name", "tid", "ts_ms", "ms", "nested": {name [category]: [count, ms]},
    "runtime": {...}}. `nested` counts the events directly below the call (they add up to at
    most the call); `runtime` every CUDA runtime and driver call at any depth. A match inside
    another match is part of it."""
    spans = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    window = None if step is None else _step_window(spans, step)
    if step is not None and window is None:
        raise SystemExit(f"trace_ops: no ProfilerStep#{step} span in the trace")
    threads = defaultdict(list)
    for e in spans:
        threads[(e.get("pid"), e.get("tid"))].append(TraceOp(e))
    t0 = min((e["ts"] for e in spans), default=0.0)

    def is_call(op: TraceOp) -> bool:
        return (pattern in op.name and op.cat in ("cpu_op", "user_annotation")
                and (window is None or window[0] <= op.ts < window[1]))  # fmt: skip

    calls: dict[int, dict] = {}
    for (_, tid), ops in threads.items():
        nest_ops(ops)
        for op in ops:
            chain, up = [], op
            while up is not None:
                chain.append(up)
                up = up.parent
            outer = next((a for a in reversed(chain) if is_call(a)), None)  # outermost match
            if outer is None:
                continue
            call = calls.setdefault(id(outer), {
                "name": outer.name, "tid": tid, "ts_ms": (outer.ts - t0) / 1000,
                "ms": (outer.end - outer.ts) / 1000, "nested": {}, "runtime": {},
            })  # fmt: skip
            if op.parent is outer:
                _add(call["nested"], op)
            if op.cat in ("cuda_runtime", "cuda_driver"):
                _add(call["runtime"], op)
    return sorted(calls.values(), key=lambda c: c["ts_ms"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path)
    p.add_argument("pattern")
    p.add_argument("--step", type=int, help="only calls inside ProfilerStep#N")
    p.add_argument("--top", type=int, default=12, help="nested names shown per call")
    p.add_argument("--calls", type=int, default=6, help="calls shown, slowest first")
    args = p.parse_args(argv)
    calls = inside(read_trace(args.trace), args.pattern, args.step)
    if not calls:
        print(f"trace_ops: no call of an op matching {args.pattern!r}")
        return 1
    total = sum(c["ms"] for c in calls)
    print(f"{len(calls)} call(s) matching {args.pattern!r}, {total:.2f} ms in all")
    for c in sorted(calls, key=lambda c: -c["ms"])[: args.calls]:
        accounted = sum(ms for _, ms in c["nested"].values())
        print(f"\n{c['name']}  thread {c['tid']}  at {c['ts_ms']:.1f} ms: {c['ms']:.2f} ms "
              f"({c['ms'] - accounted:.2f} ms outside nested events)")  # fmt: skip
        for title, table in (
            ("", c["nested"]),
            ("CUDA runtime and driver calls, any depth:", c["runtime"]),
        ):
            if title and table:
                print(f"  {title}")
            for label, (n, ms) in sorted(table.items(), key=lambda kv: -kv[1][1])[: args.top]:
                print(f"  {ms:9.2f} ms  {n:5d}x  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
