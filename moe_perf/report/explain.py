"""Where the difference comes from: time per step by category for both arms (`explain=true`).

With `explain=true` each arm, after its measured steps, runs a few more steps under
torch.profiler (`trainer.explain_steps`) and leaves Chrome traces in `<arm dir>/explain/`. This
reads them and splits each profiled step into categories (dense GEMM, expert GEMM, attention,
all-to-all, ...):

* on GPU the device kernels, each attributed through its launching CPU op (the kernel's
  `External id`) so that a GEMM inside the routed experts counts as expert GEMM; the time the
  GPU sat idle inside the step is `host gaps/idle` (launch overhead, host syncs, Python);
* on CPU the CPU ops' self time (an op's time less its children's) on the training thread; the
  step's time outside any op is `host gaps/idle` (Python between ops).

Expert GEMMs are told from dense ones by the name (grouped GEMM, the reference trainer's
`moe_perf::expert_bmm` ops) or by the trainer's profiler
scope `moe_perf.experts` around the experts' forward; backward ops have no scope of their own
and are matched to their forward op through the profiler's autograd sequence number.

Steps are split at the profiler's `ProfilerStep#N` markers, the first profiled step dropped
(when 3 or more). A category's noise is the wider per-step range (max - min) of the two arms,
each without its one step farthest from its median once it has 4 or more (one descheduled
step or GC pause would otherwise hide a move of every other step), and never less than
NOISE_FLOOR of the base arm's profiled step: on an H200 the per-step range of a GEMM category
is about a microsecond, and a change that small is not a move. On a CPU the floor is higher
(NOISE_FLOOR_CPU): op times there move with the load and clock of a shared machine between
processes more than within one, so two arms can each be steady and still sit a few percent
apart in an A/A run.
The runner never imports torch: traces are JSON.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

# profiled steps per arm when `explain=true` and the trainer sets none; the first is dropped
EXPLAIN_STEPS = 4
EXPERT_SCOPE = "moe_perf.experts"
TOP_CHANGES = 10
NOISE_FLOOR = 0.005  # of the base arm's profiled step: smaller changes are never called moves
NOISE_FLOOR_CPU = 0.03  # the same on a CPU trace

CATEGORIES = (  # key, label; the order of the tables
    ("dense_gemm", "dense GEMM"),
    ("expert_gemm", "expert/grouped GEMM"),
    ("attention", "attention"),
    ("all_to_all", "all-to-all"),
    ("collectives", "other collectives"),
    ("optimizer", "optimizer"),
    ("norms_elementwise", "norms/elementwise"),
    ("routing", "routing (sort/scatter/gather)"),
    ("copies", "memory copies"),
    ("host_idle", "host gaps/idle"),
    ("other", "other"),
)
LABELS = dict(CATEGORIES)

# A name anywhere in an op's chain (the op and the ops around it) that decides the category
# whatever the op itself is: the copies inside `Optimizer.step` are optimizer time.
_SCOPES = (
    ("all_to_all", re.compile(r"all_?to_?all")),
    (
        "collectives",
        re.compile(
            r"nccl|gloo:|c10d::|c10d_functional|all_?reduce|all_?gather|reduce_?scatter|broadcast"
            r"|barrier|sendrecv"
        ),
    ),  # fmt: skip
    ("optimizer", re.compile(r"^optimizer\.|_foreach_|adamw|_fused_adam|multi_tensor_apply")),
)
_SCOPE_KEYS = {key for key, _ in _SCOPES}
# Otherwise the innermost name of the chain that matches, in this order, decides (an
# `aten::t` inside `aten::linear` is GEMM time; a copy kernel is a copy before an elementwise).
_NAMES = (
    ("attention", re.compile(r"scaled_dot_product|flash|fmha|attention|sdpa")),
    (
        "gemm",
        re.compile(
            r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_grouped_mm|mv)$|mmbackward|gemm|cutlass"
            r"|cublas|nvjet|xmma|wgmma|grouped_mm|expert_bmm"
        ),
    ),  # fmt: skip
    ("routing", re.compile(r"sort|topk|scatter|gather|index|cumsum|bincount|histc|unique")),
    (
        "copies",
        re.compile(
            r"memcpy|memset|copy|^aten::(to|clone|contiguous|cat|stack|zero_|zeros|fill_|empty"
            r"|empty_strided|empty_like|new_zeros|new_empty|full|full_like|ones_like|zeros_like)$"
            r"|catarray"
        ),
    ),  # fmt: skip
    (
        "norms_elementwise",
        re.compile(
            r"norm|elementwise|vectorized|reduce|softmax|silu|gelu|sigmoid|tanh|(?<![a-z])exp(?![a-z])|log|mul|add"
            r"|sub|div|pow|sqrt|neg|abs|sum|mean|max|min|where|clamp|cos|sin|rope|triton|nll_loss"
            r"|cross_entropy|relu|dropout|reciprocal|masked|unrolled|accumulategrad|type_as|lerp"
            r"|square|fused"
        ),
    ),  # fmt: skip
)
_GROUPED = re.compile(r"grouped|expert")  # the reference trainer's moe_perf::expert_bmm too
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_OP_CATS = ("cpu_op", "user_annotation")
_STEP = re.compile(r"^ProfilerStep#\d+$")
_EPS_US = 1e-3


def explain_steps(cfg: Any) -> int:
    """Profiled steps per arm: 0 unless `explain=true` (then the trainer's own, or 3)."""
    if not cfg.get("explain", False):
        return 0
    return int(cfg.trainer.get("explain_steps") or EXPLAIN_STEPS)


def categorize(chain: list[str], in_experts: bool = False) -> str:
    """The category key of an op or kernel; `chain` = its name, then its enclosing ops'."""
    low = [name.lower() for name in chain]
    for key, pattern in _SCOPES:
        if any(pattern.search(name) for name in low):
            return key
    for name in low:
        for key, pattern in _NAMES:
            if pattern.search(name):
                if key != "gemm":
                    return key
                grouped = any(_GROUPED.search(n) for n in low)
                return "expert_gemm" if in_experts or grouped else "dense_gemm"
    return "other"


# ---- one trace -------------------------------------------------------------------------------


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
        steps.add(i, "host_idle" if op.scope and key not in _SCOPE_KEYS else key, op.name, self_us)
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


# ---- one arm ---------------------------------------------------------------------------------

# Where each trainer's profiler leaves its traces, under <arm dir>/explain: the reference
# trainer's trace_rank<r>.json; torchtitan's iteration_<N>/rank<r>_trace.json; Megatron's
# (PyTorch profiler, TensorBoard handler) <host>_<pid>.<time>.pt.trace.json.
TRACE_GLOBS = ("trace_rank*.json", "*/rank*_trace.json", "*.pt.trace.json", "*.pt.trace.json.gz")


def trace_files(arm_dir: Path) -> list[Path]:
    root = Path(arm_dir) / "explain"
    return sorted({p for pattern in TRACE_GLOBS for p in root.glob(pattern)})


def _stat(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _mean_over_ranks(per_rank: list[list[float]]) -> list[float]:
    n = min(len(v) for v in per_rank)
    return [statistics.fmean(v[i] for v in per_rank) for i in range(n)]


def memory_of(record: dict, steps_info: dict) -> dict:
    """Peak memory of an arm, GiB: allocated and reserved where the trainer reports both."""
    alloc = steps_info.get("peak_mem_allocated_gib")
    reserved = steps_info.get("peak_mem_reserved_gib")
    log = record.get("log")
    if (alloc is None or reserved is None) and record.get("log_format") == "megatron" and log:
        alloc, reserved = _megatron_memory(Path(log))
    reported = (record.get("summary") or {}).get("peak_mem_gib")
    return {"allocated_gib": alloc, "reserved_gib": reserved, "reported_gib": reported}


_MEGATRON_MEM = re.compile(
    r"max allocated:\s*([\d.]+)\s*\|\s*reserved:\s*[\d.]+\s*\|\s*max reserved:\s*([\d.]+)"
)


def _megatron_memory(log: Path) -> tuple[float | None, float | None]:
    """Megatron's memory report, `... | max allocated: X | reserved: Y | max reserved: Z` (MiB)."""
    if not log.is_file():
        return None, None
    found = _MEGATRON_MEM.findall(log.read_text(errors="replace"))
    if not found:
        return None, None
    return (max(float(a) for a, _ in found) / 1024, max(float(r) for _, r in found) / 1024)


def arm_breakdown(record: dict) -> dict:
    """The breakdown of one run (its record's arm dir), or {"missing": why}."""
    arm_dir = Path(record.get("arm_dir") or ".")
    steps_file = arm_dir / "explain" / "steps.json"
    steps_info = json.loads(steps_file.read_text()) if steps_file.is_file() else {}
    memory = memory_of(record, steps_info)
    files = trace_files(arm_dir)
    if not files:
        return {"missing": _why_missing(record, arm_dir), "memory": memory}
    ranks = [trace_breakdown(read_trace(p), steps_info.get("steps")) for p in files]
    ranks = [_drop_first_step(r) for r in ranks if r["steps"]]
    if not ranks:
        return {"missing": f"the traces in {arm_dir / 'explain'} hold no profiled step",
                "memory": memory}  # fmt: skip
    names = {n for r in ranks for n in r["names"]}
    zeros = [0.0] * max(r["steps"] for r in ranks)
    return {
        "traces": [str(p) for p in files],
        "steps": min(r["steps"] for r in ranks),
        "device": ranks[0]["device"],
        "ranks": len(ranks),
        "expert_scope": all(r["expert_scope"] for r in ranks),
        "step_markers": all(r["step_markers"] for r in ranks),
        "step_ms": _mean_over_ranks([r["step_ms"] for r in ranks]),
        "wall_s": steps_info.get("wall_s"),
        "categories": {
            k: _mean_over_ranks([r["categories"][k] for r in ranks]) for k, _ in CATEGORIES
        },  # fmt: skip
        "names": {n: _mean_over_ranks([r["names"].get(n, zeros) for r in ranks]) for n in names},
        "memory": memory,
        "measured_step_s": (record.get("summary") or {}).get("step_time_s"),
    }


def _drop_first_step(rank: dict) -> dict:
    """The first profiled step is left out when 3 or more are split (as the measured summary
    drops step 1): on CPU it ran up to 40% slower than the others, the profiler warming up."""
    if not rank["step_markers"] or len(rank["step_ms"]) < 3:
        return rank
    return {
        **rank,
        "steps": rank["steps"] - 1,
        "step_ms": rank["step_ms"][1:],
        "categories": {k: v[1:] for k, v in rank["categories"].items()},
        "names": {k: v[1:] for k, v in rank["names"].items()},
    }


def _why_missing(record: dict, arm_dir: Path) -> str:
    trainer = ((record.get("config") or {}).get("trainer") or {}).get("name", "?")
    if record.get("status") != "ok":
        return "the arm failed, so it has no profiled steps"
    if trainer == "command":
        return ("trainer=command: moe_perf cannot switch that trainer's profiler on; pass its "
                "own profiler flags in trainer.command to write traces into "
                f"{arm_dir / 'explain'}")  # fmt: skip
    return f"trainer={trainer} wrote no trace into {arm_dir / 'explain'}"


# ---- both arms -------------------------------------------------------------------------------


def spread(values: list[float]) -> float:
    """The per-step range, without the one step farthest from the median once there are 4 or
    more: a single descheduled step must not hide a move that every other step shows."""
    if len(values) >= 4:
        mid = statistics.median(values)
        values = sorted(values, key=lambda v: abs(v - mid))[:-1]
    return max(values) - min(values)


def _arm_summary(runs: list[dict]) -> dict:
    """Runs of one arm: medians of run medians; the per-step spread over all runs (noise)."""
    ok = [r for r in runs if "missing" not in r]

    def over_runs(series: list[list[float]]) -> dict:
        medians = [statistics.median(s) for s in series if s]
        values = [v for s in series for v in s]
        return {"median": statistics.median(medians), "min": min(values), "max": max(values),
                "spread": spread(values)}  # fmt: skip

    names = {n for r in ok for n in r["names"]}
    zeros = [[0.0] * len(r["step_ms"]) for r in ok]
    return {
        "runs": len(ok),
        "device": ok[0]["device"],
        "ranks": ok[0]["ranks"],
        "steps_profiled": sum(r["steps"] for r in ok),
        "per_step": all(r["step_markers"] for r in ok),  # else one value per trace: no noise
        "expert_scope": all(r["expert_scope"] for r in ok),
        "step_ms": over_runs([r["step_ms"] for r in ok]),
        "step_values": [v for r in ok for v in r["step_ms"]],
        "categories": {k: over_runs([r["categories"][k] for r in ok]) for k, _ in CATEGORIES},
        "names": {
            n: statistics.median(
                statistics.median(r["names"].get(n, z)) for r, z in zip(ok, zeros, strict=True)
            )
            for n in names
        },  # fmt: skip
        "traces": [t for r in ok for t in r["traces"]],
        "measured_step_ms": _median_ms([r.get("measured_step_s") for r in ok]),
    }


def _memory_summary(runs: list[dict]) -> dict:
    out = {}
    for key in ("allocated_gib", "reserved_gib", "reported_gib"):
        values = [r["memory"][key] for r in runs if r["memory"].get(key) is not None]
        out[key] = max(values) if values else None
    return out


def explain_group(records: list[dict]) -> dict | None:
    """The explain section of one (model, tag) group; None when no arm asked for it."""
    asked = any((r.get("config") or {}).get("explain") for r in records)
    runs: dict = defaultdict(list)
    for record in records:
        runs[record.get("arm")].append(arm_breakdown(record))
    have = {a: [r for r in rs if "missing" not in r] for a, rs in runs.items()}
    if not asked and not any(have.values()):
        return None
    trainers = {((r.get("config") or {}).get("trainer") or {}).get("name") for r in records}
    section: dict = {
        "source": _source(trainers),
        "memory": {a: _memory_summary(rs) for a, rs in runs.items()},
        "missing": {a: rs[0]["missing"] for a, rs in runs.items() if not have[a]},
        "arms": {a: _arm_summary(rs) for a, rs in have.items() if rs},
    }
    base, feat = section["arms"].get("base"), section["arms"].get("feat")
    if base and feat:
        section.update(_differences(base, feat))
    return section


def _source(trainers: set) -> str:
    if trainers & {"torchtitan", "megatron"}:
        return ("the trainer's own profiler over its last measured steps (it profiles inside "
                "its loop, not after it): profiled steps, not the measured medians, and the "
                "profiler slowed those steps a little")  # fmt: skip
    return ("profiled steps run after the measured ones (trainer.explain_steps), not the "
            "measured steps; the profiler adds a little host time per op")  # fmt: skip


def noise_floor(arm: dict) -> float:
    """The smallest noise, as a fraction of the arm's profiled step, for its device."""
    return NOISE_FLOOR_CPU if arm["device"] == "cpu" else NOISE_FLOOR


def _differences(base: dict, feat: dict) -> dict:
    rows = []
    for key, label in CATEGORIES:
        b, f = base["categories"][key], feat["categories"][key]
        delta = f["median"] - b["median"]
        steps_known = all(a["per_step"] and len(a["step_values"]) > 1 for a in (base, feat))
        floor = noise_floor(base) * base["step_ms"]["median"]
        noise = max(b["spread"], f["spread"], floor) if steps_known else None
        rows.append({
            "category": key, "label": label, "base_ms": b["median"], "feat_ms": f["median"],
            "delta_ms": delta,
            "pct": delta / b["median"] * 100 if b["median"] > 0 else None,
            "noise_ms": noise,
            "noise_is_floor": steps_known and floor >= max(b["spread"], f["spread"]),
            "beyond_noise": None if noise is None else abs(delta) > noise,
        })  # fmt: skip
    moved = max(rows, key=lambda r: abs(r["delta_ms"]))
    changes = []
    for name in set(base["names"]) | set(feat["names"]):
        b, f = base["names"].get(name, 0.0), feat["names"].get(name, 0.0)
        changes.append({"name": name, "base_ms": b, "feat_ms": f, "delta_ms": f - b})
    changes.sort(key=lambda c: -abs(c["delta_ms"]))
    total = feat["step_ms"]["median"] - base["step_ms"]["median"]
    return {
        "categories": rows,
        "moved_most": moved["category"],
        "step_ms_delta": total,
        "top_changes": changes[:TOP_CHANGES],
    }


# ---- for people ------------------------------------------------------------------------------


def _ms(value: float | None, sign: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.3f}" if sign else f"{value:.3f}"


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown(group: dict) -> list[str]:
    """The explain section's Markdown lines for a comparison group ([] if it has none)."""
    section = group.get("explain")
    if not section:
        return []
    lines = ["", "### Where the time goes (explain)", ""]
    arms = section["arms"]
    described = ", ".join(
        f"{a}: {s['steps_profiled']} step(s) x {s['ranks']} rank(s) on {s['device']}"
        for a, s in arms.items()
    )
    lines.append(f"From {section['source']}" + (f" ({described})." if described else "."))
    for arm, why in section["missing"].items():
        lines.append(f"No breakdown for {arm}: {why}.")
    lines.append("")
    if "categories" in section:
        lines += _category_table(section) + [""] + _moved_sentence(section) + [""]
        lines += _overhead_lines(arms)
        if section.get("plot"):
            lines += [f"The category deltas as a picture: {section['plot']}.", ""]
        if not (arms["base"]["expert_scope"] and arms["feat"]["expert_scope"]):
            lines += ["Expert GEMMs are counted as such only where grouped (no "
                      f"`{EXPERT_SCOPE}` profiler scope in the trace).", ""]  # fmt: skip
        lines += ["| op or kernel (category) | base ms | feat ms | delta ms |",
                  "|---|---:|---:|---:|"]  # fmt: skip
        for c in section["top_changes"]:
            name = c["name"].replace("|", "\\|")
            lines.append(f"| `{name}` | {_ms(c['base_ms'])} | {_ms(c['feat_ms'])} | "
                         f"{_ms(c['delta_ms'], True)} |")  # fmt: skip
        lines.append("")
    lines += _memory_lines(section, group)
    return lines


def _category_table(section: dict) -> list[str]:
    base, feat = section["arms"]["base"], section["arms"]["feat"]
    lines = ["| category | base ms/step | feat ms/step | delta ms | delta % | noise ms |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for row in section["categories"]:
        if not row["base_ms"] and not row["feat_ms"]:
            continue
        pct = "-" if row["pct"] is None else f"{row['pct']:+.1f}%"
        mark = " *" if row["beyond_noise"] else ""
        floor = " (floor)" if row.get("noise_is_floor") else ""
        lines.append(
            f"| {row['label']} | {_ms(row['base_ms'])} | {_ms(row['feat_ms'])} | "
            f"{_ms(row['delta_ms'], True)}{mark} | {pct} | {_ms(row['noise_ms'])}{floor} |"
        )
    added = {a: categories_added_up(s) for a, s in (("base", base), ("feat", feat))}
    lines.append(f"| categories added up | {_ms(added['base'])} | {_ms(added['feat'])} | "
                 f"{_ms(added['feat'] - added['base'], True)} | | |")  # fmt: skip
    b, f = base["step_ms"]["median"], feat["step_ms"]["median"]
    pct = f"{(f - b) / b * 100:+.1f}%" if b else "-"
    lines.append(f"| profiled step | {_ms(b)} | {_ms(f)} | {_ms(f - b, True)} | {pct} | |")
    lines.append("")
    lines.append(
        "`*`: the difference is larger than the category's noise (the wider per-step range "
        "of the two arms, each without its step farthest from its median, at least "
        f"{noise_floor(base):.1%} of the base step)."
    )
    if any(row.get("noise_is_floor") for row in section["categories"]):
        lines += ["", _floor_note(base)]
    lines += ["", _added_up_note(added["base"], b, base["device"])]
    return lines


def categories_added_up(arm: dict) -> float:
    return sum(c["median"] for c in arm["categories"].values())


def _floor_note(base: dict) -> str:
    why = (
        "on a CPU, op times move with the load and clock of a shared machine between "
        "processes more than within one, so two arms sit a few percent apart even in an A/A run"
        if base["device"] == "cpu"
        else "a change that small is not a move (a GEMM category's per-step range is about a "
        "microsecond)"
    )
    floor = f"{noise_floor(base):.1%} of the base step"
    return (f"`(floor)`: the category's own per-step range is smaller than the floor, {floor}, "
            f"so the floor is its noise: {why}.")  # fmt: skip


def _added_up_note(added_ms: float, step_ms: float, device: str) -> str:
    """Each row is a median over the profiled steps on its own; within one step the categories
    add up to the step: self times and the time outside any op on a CPU, kernels and GPU idle
    on a GPU (where kernels of two streams overlap, both count)."""
    within = "Within one step they add up to it"
    if device != "cpu":
        within += ", but for kernels that overlap on two streams"
    return (f"Each category is its own median over the profiled steps, and medians of the parts "
            f"need not add up to the median of the whole: base's add up to {added_ms:.1f} ms "
            f"against a {step_ms:.1f} ms profiled step. {within}; the gap is that, not time "
            f"left out.")  # fmt: skip


def _moved_sentence(section: dict) -> list[str]:
    row = next(r for r in section["categories"] if r["category"] == section["moved_most"])
    pct = "" if row["pct"] is None else f", {row['pct']:+.1f}%"
    words = "more" if row["delta_ms"] > 0 else "less"
    text = (f"Moved most: {row['label']}, {abs(row['delta_ms']):.3f} ms per step {words} in "
            f"feat ({row['base_ms']:.3f} -> {row['feat_ms']:.3f} ms{pct})")  # fmt: skip
    if row["beyond_noise"] is None:
        text += (
            "; its noise is unknown (no per-step values: one profiled step, or a trace "
            "without ProfilerStep markers)"
        )
    elif row["beyond_noise"]:
        text += f", beyond its noise of {row['noise_ms']:.3f} ms"
    else:
        text += f", within its noise of {row['noise_ms']:.3f} ms: no category moved beyond noise"
    lines = [text + "."]
    base, feat = section["arms"]["base"], section["arms"]["feat"]
    if base["runs"] == 1 and feat["runs"] == 1:
        lines += ["", "One run per arm: the noise is the spread of steps within each run; a drift "
                  "between the two runs (other load on the machine, clocks) is not in it and "
                  "moves every category alike. Repeat the arms (-m repeat=0,1 arm=base,feat) "
                  "to include the run-to-run spread."]  # fmt: skip
    return lines


def _median_ms(seconds: list) -> float | None:
    known = [v for v in seconds if v is not None]
    return statistics.median(known) * 1e3 if known else None


def _overhead_lines(arms: dict) -> list[str]:
    """How much longer the profiled steps took than the measured ones: the profiler's cost per
    op is inside the breakdown, so an op-heavy category reads larger than it runs."""
    pairs = [(a, s["step_ms"]["median"], s["measured_step_ms"]) for a, s in arms.items()]
    if any(m is None for _, _, m in pairs):
        return []
    shown = "; ".join(f"{a} {p:.1f} ms profiled, {m:.1f} ms measured" for a, p, m in pairs)
    return [f"Step time with and without the profiler: {shown}. The profiler's cost per op is "
            "inside these categories: many small ops (CPU, host-bound steps) read larger than "
            "they run. For how much slower, read the measured step time; for where, this.",
            ""]  # fmt: skip


def _memory_lines(section: dict, group: dict) -> list[str]:
    memory = section["memory"]
    if not memory:
        return []
    step = (group.get("difference") or {}).get("step_time_s")
    change = f"{step['pct']:+.2f}%" if step else "-"
    lines = ["| arm | peak allocated GiB | peak reserved GiB | peak as reported GiB | "
             "step time change |", "|---|---:|---:|---:|---:|"]  # fmt: skip
    for arm, m in memory.items():
        shown = change if arm == "feat" else ""
        lines.append(f"| {arm} | {_gib(m['allocated_gib'])} | {_gib(m['reserved_gib'])} | "
                     f"{_gib(m['reported_gib'])} | {shown} |")  # fmt: skip
    if all(m["allocated_gib"] is None for m in memory.values()):
        lines.append("")
        lines.append("Allocated and reserved are not reported by this trainer on this device; "
                     "`peak as reported` is the trainer's own figure (the reference trainer: "
                     "max reserved on GPU, its own peak RSS on CPU).")  # fmt: skip
    return lines + [""]


def plot(report: dict, path: Path) -> Path | None:
    """A bar chart of the category deltas (feat - base, ms/step), one panel per group."""
    groups = [g for g in report["groups"] if (g.get("explain") or {}).get("categories")]
    if not groups:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(groups), 1, figsize=(8, 3.6 * len(groups)), squeeze=False)
    for ax, group in zip(axes[:, 0], groups, strict=True):
        rows = [r for r in group["explain"]["categories"] if r["base_ms"] or r["feat_ms"]]
        labels = [r["label"] for r in rows]
        deltas = [r["delta_ms"] for r in rows]
        noise = [r["noise_ms"] or 0.0 for r in rows]
        colours = ["tab:orange" if r["beyond_noise"] else "tab:gray" for r in rows]
        ax.barh(labels, deltas, xerr=noise, color=colours, ecolor="black", capsize=3)
        ax.axvline(0, color="black", linewidth=0.8)
        ax.invert_yaxis()
        ax.set_xlabel("feat - base, ms per profiled step (error bar: noise)")
        ax.set_title(f"{group['model']}  {group['tag']}  (profiled steps, not measured ones)",
                     fontsize=9)  # fmt: skip
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plot(report: dict, out_dir: Path) -> Path | None:
    """explain.png in out_dir when a group has a breakdown; its name goes into those sections."""
    path = plot(report, Path(out_dir) / "explain.png")
    for group in report["groups"]:
        if (group.get("explain") or {}).get("categories"):
            group["explain"]["plot"] = path.name if path else None
    return path
