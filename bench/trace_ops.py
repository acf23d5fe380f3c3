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

from moe_perf.report.explain import read_trace  # noqa: E402


def _spans(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _step_window(spans: list[dict], step: int) -> tuple[float, float] | None:
    # the host's span (a GPU trace also has the step's `gpu_user_annotation`, later on the GPU)
    marks = [e for e in spans if e.get("name") == f"ProfilerStep#{step}"
             and e.get("cat") == "user_annotation"]  # fmt: skip
    if not marks:
        return None
    return min(e["ts"] for e in marks), max(e["ts"] + e["dur"] for e in marks)


def _add(table: dict[str, list], label: str, event: dict) -> None:
    slot = table.setdefault(label, [0, 0.0])
    slot[0] += 1
    slot[1] += event["dur"] / 1000


def inside(trace: dict, pattern: str, step: int | None = None) -> list[dict]:
    """Each call of an op whose name holds `pattern` (in trace order), with what nests in it on
    its thread: {"name", "tid", "ts_ms", "ms", "nested": {name [category]: [count, ms]},
    "runtime": {...}}. `nested` counts events at the outermost level below the call (they
    add up to at most the call); `runtime` every CUDA runtime and driver call at any depth."""
    spans = _spans(trace.get("traceEvents", []))
    window = None if step is None else _step_window(spans, step)
    if step is not None and window is None:
        raise SystemExit(f"trace_ops: no ProfilerStep#{step} span in the trace")
    by_thread = defaultdict(list)
    for e in spans:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for events in by_thread.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
    t0 = min((e["ts"] for e in spans), default=0.0)
    calls = []
    for key, events in by_thread.items():
        i = 0
        while i < len(events):
            e = events[i]
            matched = pattern in e.get("name", "") and e.get("cat") in ("cpu_op", "user_annotation")
            if window and not (window[0] <= e["ts"] < window[1]):
                matched = False
            if not matched:
                i += 1
                continue
            end = e["ts"] + e["dur"]
            nested: dict[str, list] = {}
            runtime: dict[str, list] = {}
            covered_until = e["ts"]
            j = i + 1
            while j < len(events) and events[j]["ts"] < end:
                c = events[j]
                label = f"{c.get('name', '?')} [{c.get('cat', '?')}]"
                if c["ts"] >= covered_until:  # outermost below the call
                    _add(nested, label, c)
                    covered_until = c["ts"] + c["dur"]
                if c.get("cat") in ("cuda_runtime", "cuda_driver"):
                    _add(runtime, label, c)
                j += 1
            calls.append(
                {
                    "name": e["name"],
                    "tid": key[1],
                    "ts_ms": (e["ts"] - t0) / 1000,
                    "ms": e["dur"] / 1000,
                    "nested": nested,
                    "runtime": runtime,
                }
            )
            i = j  # a match nested in this one is part of it
    return sorted(calls, key=lambda c: c["ts_ms"])


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
