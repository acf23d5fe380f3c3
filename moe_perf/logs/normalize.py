"""Steps brought to the contract's meaning, and the words that say how.

Normalization: time per optimizer step; tokens/s global (global batch x sequence length / step
time where the shape is known); a step printed by several ranks is one step, with the slowest
rank's time and the largest memory; values averaged over a log interval longer than one step
are flagged (`interval_steps`); non-finite or negative values and 0 TFLOP/s or MFU are unknown
(None). `derivations` says, in words, what was derived and how: they are kept in the record
beside the figures. Each derivation applied to a step is a tag in `used`.
"""

from __future__ import annotations

from moe_perf.logs.steps import RunShape, positive


def normalize(cur: dict, prev: dict | None, used: set[str], shape: RunShape) -> dict:
    """The contract sample of one combined step (`prev`: the step before it, or None)."""
    step_time, tps = _step_time(cur, prev, used, shape), cur["tokens_per_s"]
    tokens, world = shape.tokens_per_step(cur.get("global_batch")), shape.world_size
    tps_device = cur["tokens_per_s_device"]
    if tps is None and tokens and step_time:
        tps = tokens / step_time
        used.add("tps_from_shape")
    elif tps is None and tps_device and world:
        tps = tps_device * world
        used.add("tps_from_device")
    sample = {
        "step": cur["step"],
        "max_steps": cur.get("max_steps"),
        "step_time_s": step_time,
        "tokens_per_s": tps,
    }
    for key in ("peak_mem_gib", "loss", "tflops", "mfu"):
        sample[key] = cur[key]
    if tps is None and tps_device is not None:
        sample["tokens_per_s_device"] = tps_device
    return sample


def _step_time(cur: dict, prev: dict | None, used: set[str], shape: RunShape) -> float | None:
    """As printed; else from tokens/s (per device or global) and the shape; else from the
    timestamps of this step's line and the one before."""
    tokens, world = shape.tokens_per_step(cur.get("global_batch")), shape.world_size
    step_time, tps, tps_device = cur["step_time_s"], cur["tokens_per_s"], cur["tokens_per_s_device"]
    if step_time is not None:
        return step_time
    if tps_device and tokens and world:
        used.add("time_from_device_tps")
        return tokens / world / tps_device
    if tps and tokens:
        used.add("time_from_tps")
        return tokens / tps
    if prev is not None and cur["timestamp"] and prev["timestamp"]:
        used.add("time_from_timestamps")
        delta = cur["timestamp"] - prev["timestamp"]
        return positive(delta / (cur["step"] - prev["step"]))
    return None


def normalize_all(combined: list[dict], used: set[str], shape: RunShape) -> list[dict]:
    """Every step's sample in order, an interval longer than one step marked, skipped
    iterations (no update) left out."""
    steps, prev = [], None
    for cur in combined:
        sample = normalize(cur, prev, used, shape)
        interval = cur["step"] - prev["step"] if prev is not None else 1
        if interval > 1:
            sample["interval_steps"] = interval
        if cur["skipped"]:
            sample["skipped_iterations"] = int(cur["skipped"])
        else:
            steps.append(sample)
        prev = cur
    return steps


# ---- the words -------------------------------------------------------------------------------


def derivations(shape: RunShape, used: set[str], combined: list[dict], steps: list[dict],
                corrections: list[str]) -> list[str]:  # fmt: skip
    """What was derived and how, in the order a reader checks it: the step time (then the
    format's own corrections of it), tokens/s, what stays unknown, how the lines were read."""
    tokens = shape.tokens_per_step(
        next((c["global_batch"] for c in combined if c["global_batch"]), None)
    )
    return (
        _time_notes(shape, used, tokens)
        + corrections
        + _tps_notes(shape, used, tokens)
        + _unknown_notes(steps)
        + _reading_notes(used, combined, steps)
    )


def _time_notes(shape: RunShape, used: set[str], tokens: float | None) -> list[str]:
    notes = []
    if "time_from_device_tps" in used:
        notes.append(
            f"step_time_s = global batch x sequence length / world / tps = "
            f"{tokens:g} / {shape.world_size} / tps (torchtitan's tps is tokens/s per device)"
        )
    if "time_from_tps" in used:
        notes.append(f"step_time_s = {tokens:g} tokens per step / tokens_per_s")
    if "time_from_timestamps" in used:
        notes.append(
            "step_time_s derived from the lines' timestamps (delta time / delta "
            "step); the first step has none"
        )
    return notes


def _tps_notes(shape: RunShape, used: set[str], tokens: float | None) -> list[str]:
    notes = []
    if "tps_from_shape" in used:
        notes.append(
            f"tokens_per_s = global batch x sequence length / step time = "
            f"{tokens:g} / step_time_s (global)"
        )
    if "tps_from_device" in used:
        notes.append(f"tokens_per_s = per-device tps x world ({shape.world_size}) (global)")
    return notes


def _unknown_notes(steps: list[dict]) -> list[str]:
    notes = []
    unknown_tps = [s for s in steps if s["tokens_per_s"] is None]
    if any("tokens_per_s_device" in s for s in unknown_tps):
        notes.append(
            "tokens_per_s unknown where the per-device figure cannot be made "
            "global: give the global batch, sequence length and world size"
        )
    elif unknown_tps:  # from a step time: tokens per step is all it takes
        notes.append(
            "tokens_per_s unknown: the lines print none; give the global batch and "
            "sequence length (tokens/s = global batch x sequence length / step time)"
        )
    if any(s["step_time_s"] is None for s in steps[1:]):
        notes.append(
            "step time unknown for some steps: no step time, tokens/s with a known "
            "shape, or timestamps on the lines"
        )
    return notes


def _reading_notes(used: set[str], combined: list[dict], steps: list[dict]) -> list[str]:
    notes = []
    if any(c["ranks"] > 1 for c in combined):
        notes.append(
            "steps printed by several ranks: the slowest rank's step time, the "
            "largest memory over ranks"
        )
    intervals = sorted({s["interval_steps"] for s in steps if "interval_steps" in s})
    if intervals:
        notes.append(
            f"values averaged over log intervals of {', '.join(map(str, intervals))} "
            f"steps (interval_steps): log every step for per-step figures"
        )
    skipped = [c["step"] for c in combined if c["skipped"]]
    if skipped:
        notes.append(
            f"skipped iterations (no update, loss-scale overflow) not counted: "
            f"step(s) {', '.join(map(str, skipped))}"
        )
    if "memory_reports" in used:
        notes.append(
            "peak_mem_gib: the largest memory report of the run (max reserved), given to every step"
        )
    return notes
