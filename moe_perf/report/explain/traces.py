"""One profiler trace (Chrome JSON, read without torch) to milliseconds per profiled step, by
category and by op or kernel name.

* on GPU the device kernels, each attributed through its launching CPU op (the kernel's
  `External id`) so that a GEMM inside the routed experts counts as expert GEMM; the time the
  GPU sat idle inside the step is `host gaps/idle` (launch overhead, host syncs, Python);
* on CPU the CPU ops' self time (an op's time less its children's) on the training thread; the
  step's time outside any op is `host gaps/idle` (Python between ops).

Backward ops have no profiler scope of their own and are matched to their forward op inside
the experts' scope through the profiler's autograd sequence number. Steps are split at the
profiler's `ProfilerStep#N` markers.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

from moe_perf.report.explain.categories import (
    CATEGORIES,
    EXPERT_SCOPE,
    LABELS,
    SCOPE_KEYS,
    categorize,
)

_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_OP_CATS = ("cpu_op", "user_annotation")
_STEP = re.compile(r"^ProfilerStep#\d+$")
_EPS_US = 1e-3


class TraceOp:
    """One span of a trace's thread (an op, a record_function, a CUDA runtime call)."""

    __slots__ = ("name", "cat", "scope", "ts", "end", "args", "parent", "child_us")

    def __init__(self, event: dict):
        self.name, self.args = event["name"], event.get("args") or {}
        self.cat = event.get("cat")
        self.scope = event.get("cat") == "user_annotation"  # a record_function, not an op
        self.ts, self.end = float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0))
        self.parent: TraceOp | None = None
        self.child_us = 0.0

    def chain(self) -> list[str]:
        names, op = [], self
        while op is not None:
            names.append(op.name)
            op = op.parent
        return names


def nest_ops(ops: list[TraceOp]) -> None:
    """Parent links by time nesting (ops of one thread)."""
    stack: list[TraceOp] = []
    for op in sorted(ops, key=lambda o: (o.ts, -o.end)):
        while stack and stack[-1].end <= op.ts + _EPS_US:
            stack.pop()
        if stack and op.end <= stack[-1].end + _EPS_US:
            op.parent = stack[-1]
            stack[-1].child_us += op.end - op.ts
        stack.append(op)


def _union_us(spans: list[tuple[float, float]]) -> float:
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(spans):
        if cur_e is None or s > cur_e:
            busy += (cur_e - cur_s) if cur_e is not None else 0.0
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return busy + ((cur_e - cur_s) if cur_e is not None else 0.0)


def _expert_seqs(ops: list[TraceOp]) -> set:
    """Autograd sequence numbers of the ops run inside the experts' scope (their backward
    nodes carry the same number)."""
    seqs = set()
    for op in ops:
        seq = op.args.get("Sequence number")
        if seq is not None and EXPERT_SCOPE in op.chain():
            seqs.add(seq)
    return seqs


def _in_experts(op: TraceOp, seqs: set) -> bool:
    while op is not None:
        if op.name == EXPERT_SCOPE or op.args.get("Sequence number") in seqs:
            return True
        op = op.parent
    return False


class _Steps:
    """Milliseconds per profiled step, by category and by op/kernel name (with its category)."""

    def __init__(self, windows: list[tuple[float, float]], divide: int):
        self.windows, self.divide = windows, divide
        self.categories = {key: [0.0] * len(windows) for key, _ in CATEGORIES}
        self.names: dict = defaultdict(lambda: [0.0] * len(windows))

    def index(self, ts: float) -> int | None:
        for i, (s, e) in enumerate(self.windows):
            if s - _EPS_US <= ts <= e + _EPS_US:
                return i
        return None

    def add(self, i: int, key: str, name: str, us: float) -> None:
        self.categories[key][i] += us / 1e3 / self.divide
        self.names[f"{name[:120]} [{LABELS[key]}]"][i] += us / 1e3 / self.divide


def _gpu_time(steps: _Steps, kernels: list[dict], ops: list[TraceOp], seqs: set) -> None:
    """Kernel time by the category of the kernel and its launching op's chain; the GPU's idle
    time inside each step window."""
    by_ext = {op.args.get("External id"): op for op in ops if op.args.get("External id")}
    busy: list[list] = [[] for _ in steps.windows]
    for k in kernels:
        op = by_ext.get((k.get("args") or {}).get("External id"))
        start, dur = float(k["ts"]), float(k.get("dur", 0))
        i = steps.index(op.ts if op is not None else start)
        if i is None:
            continue
        chain = [k["name"], *(op.chain() if op is not None else [])]
        inside = op is not None and _in_experts(op, seqs)
        steps.add(i, categorize(chain, inside), k["name"], dur)
        busy[i].append((start, start + dur))
    for i, (s, e) in enumerate(steps.windows):
        clipped = [(max(a, s), min(b, e)) for a, b in busy[i] if b > s and a < e]
        steps.add(i, "host_idle", "GPU idle in the step", max(0.0, (e - s) - _union_us(clipped)))


def _cpu_time(steps: _Steps, ops: list[TraceOp], seqs: set, markers: bool) -> None:
    """Self time of the training thread's ops by category; a step marker's or a scope's own
    time (Python between ops) is host time."""
    for op in ops:
        i = steps.index(op.ts)
        if i is None:
            continue
        self_us = max(0.0, (op.end - op.ts) - op.child_us)
        if _STEP.match(op.name):
            steps.add(i, "host_idle", "outside any op (Python)", self_us)
            continue
        key = categorize(op.chain(), _in_experts(op, seqs))
        steps.add(i, "host_idle" if op.scope and key not in SCOPE_KEYS else key, op.name, self_us)
    if not markers and steps.windows:  # one block: the time between its top-level ops
        (s, e), covered = steps.windows[0], _union_us([(o.ts, o.end) for o in ops if not o.parent])
        steps.add(0, "host_idle", "outside any op (Python)", max(0.0, (e - s) - covered))


def trace_breakdown(trace: dict | list, steps: int | None = None) -> dict:
    """Per profiled step: ms by category and by op/kernel name, and the step's length.

    {"device": "cuda"|"cpu", "steps": n, "step_markers": bool, "expert_scope": bool,
     "step_ms": [...], "categories": {key: [ms per step]}, "names": {"name [label]": [...]}}
    A trace without ProfilerStep markers is one block: `steps` divides it.
    """
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    threads: dict = defaultdict(list)
    kernels = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in _DEVICE_CATS:
            kernels.append(e)
        elif e.get("ph") == "X" and e.get("cat") in _OP_CATS:
            threads[(e.get("pid"), e.get("tid"))].append(TraceOp(e))
    for ops in threads.values():
        nest_ops(ops)
    all_ops = [op for ops in threads.values() for op in ops]
    markers = sorted((op for op in all_ops if _STEP.match(op.name)), key=lambda o: o.ts)
    # the training thread: the one holding the step markers, else the busiest
    main = max(threads, key=lambda k: (any(_STEP.match(o.name) for o in threads[k]),
                                       len(threads[k])), default=None)  # fmt: skip
    main_ops = threads.get(main, [])
    if markers:
        split = _Steps([(m.ts, m.end) for m in markers], 1)
    else:
        tops = [op for op in main_ops if op.parent is None]
        block = [(min(o.ts for o in tops), max(o.end for o in tops))] if tops else []
        split = _Steps(block, max(int(steps or 1), 1))
    seqs = _expert_seqs(all_ops)
    if kernels:
        _gpu_time(split, kernels, all_ops, seqs)
    else:
        _cpu_time(split, main_ops, seqs, bool(markers))
    return {
        "device": "cuda" if kernels else "cpu",
        "steps": len(split.windows) * split.divide,
        "step_markers": bool(markers),
        "expert_scope": any(op.name == EXPERT_SCOPE for op in all_ops),
        "step_ms": [(e - s) / 1e3 / split.divide for s, e in split.windows],
        "categories": split.categories,
        "names": dict(split.names),
    }


def read_trace(path: Path) -> dict:
    if path.suffix == ".gz":
        import gzip

        return json.loads(gzip.decompress(path.read_bytes()))
    return json.loads(path.read_text())
