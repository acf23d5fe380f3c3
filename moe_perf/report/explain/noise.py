"""Both arms of a group side by side: each arm's runs summarized (medians of run medians), the
per-category differences, and the noise they are judged against.

A category's noise is the wider per-step range (max - min) of the two arms, each without its
one step farthest from its median once it has 4 or more (one descheduled step or GC pause
would otherwise hide a move of every other step), and never less than NOISE_FLOOR of the base
arm's profiled step: on an H200 the per-step range of a GEMM category is about a microsecond,
and a change that small is not a move. On a CPU the floor is higher (NOISE_FLOOR_CPU): op times
there move with the load and clock of a shared machine between processes more than within one,
so two arms can each be steady and still sit a few percent apart in an A/A run.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from moe_perf.report.explain.arms import arm_breakdown
from moe_perf.report.explain.categories import CATEGORIES
from moe_perf.report.results.arm import ArmRecord

TOP_CHANGES = 10
NOISE_FLOOR = 0.005  # of the base arm's profiled step: smaller changes are never called moves
NOISE_FLOOR_CPU = 0.03  # the same on a CPU trace


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


def explain_group(records: list[ArmRecord]) -> dict | None:
    """The explain section of one (model, tag) group; None when no arm asked for it."""
    asked = any(r.section("explain") for r in records)
    runs: dict = defaultdict(list)
    for record in records:
        runs[record.arm].append(arm_breakdown(record))
    have = {a: [r for r in rs if "missing" not in r] for a, rs in runs.items()}
    if not asked and not any(have.values()):
        return None
    trainers = {r.section("trainer", "name") for r in records}
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


def _median_ms(seconds: list) -> float | None:
    known = [v for v in seconds if v is not None]
    return statistics.median(known) * 1e3 if known else None
