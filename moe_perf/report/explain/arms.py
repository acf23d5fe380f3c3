"""Each arm's traces found and read: where each trainer's profiler leaves them, their
breakdowns averaged over ranks, the first profiled step dropped, and why an arm has none."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from moe_perf.logs.megatron import allocated_and_reserved_gib
from moe_perf.report.explain.categories import CATEGORIES
from moe_perf.report.explain.traces import read_trace, trace_breakdown
from moe_perf.report.results.arm import ArmRecord

# Where each trainer's profiler leaves its traces, under <arm dir>/explain: the reference
# trainer's trace_rank<r>.json; torchtitan's iteration_<N>/rank<r>_trace.json; Megatron's
# (PyTorch profiler, TensorBoard handler) <host>_<pid>.<time>.pt.trace.json.
TRACE_GLOBS = ("trace_rank*.json", "*/rank*_trace.json", "*.pt.trace.json", "*.pt.trace.json.gz")


def trace_files(arm_dir: Path) -> list[Path]:
    root = Path(arm_dir) / "explain"
    return sorted({p for pattern in TRACE_GLOBS for p in root.glob(pattern)})


def _mean_over_ranks(per_rank: list[list[float]]) -> list[float]:
    n = min(len(v) for v in per_rank)
    return [statistics.fmean(v[i] for v in per_rank) for i in range(n)]


def memory_of(record: ArmRecord, steps_info: dict) -> dict:
    """Peak memory of an arm, GiB: allocated and reserved where the trainer reports both."""
    alloc = steps_info.get("peak_mem_allocated_gib")
    reserved = steps_info.get("peak_mem_reserved_gib")
    log = record.log
    if (alloc is None or reserved is None) and record.log_format == "megatron" and log:
        alloc, reserved = _megatron_memory(Path(log))
    reported = record.summary.peak_mem_gib
    return {"allocated_gib": alloc, "reserved_gib": reserved, "reported_gib": reported}


def _megatron_memory(log: Path) -> tuple[float | None, float | None]:
    """The largest max allocated and max reserved (GiB) of Megatron's memory reports."""
    if not log.is_file():
        return None, None
    text = log.read_text(errors="replace")
    found = [m for m in map(allocated_and_reserved_gib, text.splitlines()) if m is not None]
    if not found:
        return None, None
    return max(a for a, _ in found), max(r for _, r in found)


def arm_breakdown(record: ArmRecord) -> dict:
    """The breakdown of one run (its record's arm dir), or {"missing": why}."""
    arm_dir = Path(record.arm_dir or ".")
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
        "measured_step_s": record.summary.step_time_s,
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


def _why_missing(record: ArmRecord, arm_dir: Path) -> str:
    trainer = record.section("trainer", "name") or "?"
    if not record.ok:
        return "the arm failed, so it has no profiled steps"
    if trainer == "command":
        return ("trainer=command: moe_perf cannot switch that trainer's profiler on; pass its "
                "own profiler flags in trainer.command to write traces into "
                f"{arm_dir / 'explain'}")  # fmt: skip
    return f"trainer={trainer} wrote no trace into {arm_dir / 'explain'}"
