"""Compare the arms of a sweep: load the records, group them by (model, tag), the differences.

It measures; it does not judge: no pass/fail, no thresholds on the difference. Honest
measurement, as pyperf does it: the first step (warm-up, compilation) is dropped, a run is
summarized by its medians, steps are never pooled across runs (with repeats an arm is the
median of its run medians, with the min-max spread of those), and a run whose step times
spread widely is called unstable in plain words.

The one summary rule, `summarize(steps)`, lives in records.py (metrics.json): a run read from
a console log here is summarized exactly as the runner summarizes an arm.
"""

from __future__ import annotations

import json
import statistics
from datetime import datetime, timezone
from pathlib import Path

from moe_perf.common.contract import METRICS as STEP_METRICS
from moe_perf.report import explain, logformats
from moe_perf.report.imports import import_warnings
from moe_perf.report.record import ARMS, load_record, measured_steps, summarize
from moe_perf.report.record import SCHEMA as ARM_SCHEMA
from moe_perf.report.record import config_differences as _differences
from moe_perf.report.render import render, write_outputs
from moe_perf.report.sweep import current_sweep_id

SCHEMA = "moe_perf.comparison/1"
METRICS = tuple(m for m in STEP_METRICS if m != "loss")  # compared between arms
# A run is called unstable when its step times (first step dropped) span more than this
# fraction of their median. Plain max-min rather than a standard deviation: with 7 steps one
# straggler is exactly what we want to see.
UNSTABLE_SPREAD = 0.20
MIN_STEPS_TO_JUDGE = 3


# ---- one run ---------------------------------------------------------------------------------


def stability_warning(steps: list[dict]) -> str | None:
    """A plain sentence when the run's step times spread too much to trust its median."""
    times = [s["step_time_s"] for s in measured_steps(steps) if s.get("step_time_s") is not None]
    if len(times) < MIN_STEPS_TO_JUDGE:
        return f"only {len(times)} measured step(s): too few to judge stability"
    low, high, mid = min(times), max(times), statistics.median(times)
    spread = (high - low) / mid if mid > 0 else 0.0
    if spread <= UNSTABLE_SPREAD:
        return None
    return (
        f"looks unstable: step times span {spread:.0%} of the median "
        f"({low:.4g}-{high:.4g} s, first step dropped); its numbers are less reliable"
    )


# ---- loading ---------------------------------------------------------------------------------


def _latest_sweep(records: list[dict], current: str | None) -> list[dict]:
    """Only the records of the current sweep: the one the runner's state file names, else the
    `sweep_id` whose records were written last. (A current sweep whose arms all failed before
    writing a record must not show an earlier sweep's numbers as if they were its own.)"""
    if current is not None:
        return [r for r in records if r.get("sweep_id") == current]
    newest: dict = {}
    for record in records:
        mtime = Path(record["_path"]).stat().st_mtime
        key = record.get("sweep_id")
        newest[key] = max(newest.get(key, 0.0), mtime)
    if len(newest) <= 1:
        return records
    latest = max(newest, key=newest.get)
    return [r for r in records if r.get("sweep_id") == latest]


def load_sweep(sweep_dir: Path) -> tuple[list[dict], list[str]]:
    """Every arm record under the sweep dir, current sweep only, `previous/` dirs ignored."""
    found, notes = [], []
    for path in sorted(sweep_dir.rglob("metrics.json")):
        if "previous" in path.relative_to(sweep_dir).parts:
            continue  # earlier sweeps, moved aside by the runner
        record, note = load_record(path)
        if note:
            notes.append(note)
        if record:
            found.append(record)
    records = _latest_sweep(found, current_sweep_id(sweep_dir))
    if len(records) < len(found):
        ids = sorted({str(r.get("sweep_id")) for r in records}) or [current_sweep_id(sweep_dir)]
        notes.append(
            f"{len(found) - len(records)} record(s) of earlier sweeps ignored; "
            f"showing sweep {', '.join(map(str, ids))}"
        )
    return records, notes


def record_from_log(path: Path, arm: str, fmt: str = "auto",
                    shape: logformats.RunShape | None = None) -> dict:  # fmt: skip
    """An arm record (schema moe_perf.arm/1, the fields a comparison needs) from a console log,
    its format detected (`auto`) or named, its figures normalized with the run's `shape`."""
    parsed = logformats.parse_log(path, fmt, shape)
    steps, failure = parsed.steps, parsed.failure(max_steps=0)
    return {
        "schema": ARM_SCHEMA,
        "model": "-",
        "tag": "-",
        "arm": arm,
        "repeat": 0,
        "ref": None,
        "sha": None,
        "status": "ok" if failure is None else "failed",
        "failure": failure,
        "log": str(Path(path).resolve()),
        "steps": steps,
        "summary": summarize(steps),
        "environment": parsed.env or {},
        "log_format": parsed.log_format,
        "derivations": parsed.derivations,
        "_path": str(path),
    }


def load_arm(path: Path, arm: str, fmt: str = "auto",
             shape: logformats.RunShape | None = None) -> dict:  # fmt: skip
    """A metrics.json file as it is, or a console log parsed into a record."""
    if path.suffix == ".json":
        record, note = load_record(path)
        if record is None:
            raise ValueError(note)
        record["arm"] = arm
        return record
    return record_from_log(path, arm, fmt, shape)


# ---- comparing -------------------------------------------------------------------------------


def config_differences(records: list[dict]) -> list[dict]:
    """Keys whose values differ between the records' configs (the identity rule of record.py)."""
    configs = {f"{r.get('arm')}-r{r.get('repeat', 0)}": r.get("config") or {} for r in records}
    return _differences(configs)


ENV_KEYS = ("host", "devices", "world_size", "torch", "cuda", "nccl")


def environment_differences(records: list[dict]) -> list[str]:
    """Environment fields that differ between base and feat runs: worth knowing, not a refusal
    (a cluster gives different hosts; a different GPU model or torch is another matter)."""
    notes = []
    for key in ENV_KEYS:
        seen: dict = {}
        for record in records:
            value = (record.get("environment") or {}).get(key)
            if value is not None:
                seen.setdefault(record.get("arm"), set()).add(json.dumps(value, sort_keys=True))
        if "base" in seen and "feat" in seen and seen["base"] != seen["feat"]:
            values = "; ".join(f"{arm}: {', '.join(sorted(v))}" for arm, v in sorted(seen.items()))
            notes.append(f"environment `{key}` differs between arms ({values})")
    return notes


def _run_entry(record: dict) -> dict:
    steps = record.get("steps") or []
    ok = record.get("status") == "ok"
    return {
        "arm": record.get("arm"),
        "repeat": record.get("repeat", 0),
        "status": record.get("status", "failed"),
        "exit_code": record.get("exit_code"),
        "failure": record.get("failure"),
        "sha": record.get("sha"),
        "ref": record.get("ref"),
        "log": record.get("log"),
        "metrics_json": record.get("_path"),
        "summary": summarize(steps) if steps else (record.get("summary") or {}),
        "unstable": stability_warning(steps) if ok else None,
        "step_times": [[s["step"], s.get("step_time_s")] for s in steps],
    }


def _arm_entry(runs: list[dict]) -> dict:
    ok = [r for r in runs if r["status"] == "ok"]
    entry: dict = {
        "runs_ok": len(ok),
        "runs_failed": len(runs) - len(ok),
        "shas": sorted({r["sha"] for r in runs if r["sha"]}),
        "refs": sorted({r["ref"] for r in runs if r["ref"]}),
    }
    for key in METRICS:
        values = [r["summary"].get(key) for r in ok if r["summary"].get(key) is not None]
        entry[key] = (
            {"median": statistics.median(values), "min": min(values), "max": max(values)}
            if values
            else None
        )
    return entry


_WORDS = {  # (positive difference, negative difference), feat against base
    "step_time_s": ("slower", "faster"),
    "tokens_per_s": ("faster", "slower"),
    "peak_mem_gib": ("more memory", "less memory"),
    "tflops": ("higher", "lower"),
    "mfu": ("higher", "lower"),
}


def _difference(base: dict, feat: dict, key: str) -> dict | None:
    if not base.get(key) or not feat.get(key) or not base[key]["median"]:
        return None
    b, f = base[key], feat[key]
    pct = (f["median"] - b["median"]) / b["median"] * 100.0
    more, less = _WORDS[key]
    words = more if pct > 0 else less if pct < 0 else "same"
    within = None  # unknown: one run per arm gives no run-to-run spread
    if base["runs_ok"] > 1 and feat["runs_ok"] > 1:
        within = b["min"] <= f["max"] and f["min"] <= b["max"]
    return {"pct": pct, "words": words, "within_spread": within}


def compare_group(model: str, tag: str, records: list[dict]) -> dict:
    runs = sorted(
        (_run_entry(r) for r in records),
        key=lambda r: (_arm_rank(r["arm"]), r["repeat"] or 0),
    )
    arms = {}
    for run in runs:
        arms.setdefault(run["arm"], []).append(run)
    group = {
        "model": model,
        "tag": tag,
        "arms": {name: _arm_entry(arm_runs) for name, arm_runs in arms.items()},
        "runs": runs,
        "config_differences": config_differences([r for r in records if r.get("config")]),
        "environment_differences": environment_differences(records),
        "import_warnings": import_warnings(records),
        "difference": {},
    }
    base, feat = group["arms"].get("base"), group["arms"].get("feat")
    base_shas, feat_shas = (set(a["shas"]) if a else set() for a in (base, feat))
    group["aa"] = bool(base_shas) and base_shas == feat_shas and len(base_shas) == 1
    if group["config_differences"]:
        group["status"] = "refused"
    elif not base or not feat or not base["runs_ok"] or not feat["runs_ok"]:
        group["status"] = "incomplete"
    else:
        group["status"] = "compared"
        group["difference"] = {k: _difference(base, feat, k) for k in METRICS}
    section = explain.explain_group(records)  # None unless explain=true or traces exist
    if section is not None:
        group["explain"] = section
    return group


def _arm_rank(arm: str | None) -> int:
    return ARMS.index(arm) if arm in ARMS else len(ARMS)


def compare_records(records: list[dict], notes: list[str] | None = None, **where) -> dict:
    """The comparison report (schema moe_perf.comparison/1) of arm records, per (model, tag)."""
    groups: dict = {}
    for record in records:
        groups.setdefault((record.get("model", "-"), record.get("tag", "-")), []).append(record)
    sweep_ids = sorted({str(r["sweep_id"]) for r in records if r.get("sweep_id") is not None})
    return {
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **where,
        "sweep_id": sweep_ids[0] if len(sweep_ids) == 1 else (sweep_ids or None),
        "unstable_spread": UNSTABLE_SPREAD,
        "notes": list(notes or []),
        "groups": [compare_group(m, t, rs) for (m, t), rs in sorted(groups.items())],
    }


# ---- entry points ----------------------------------------------------------------------------


def compare_sweep(sweep_dir: Path | str, write: bool = True) -> tuple[dict, str]:
    """(report, text) for a sweep directory; writes the comparison files there if `write`."""
    sweep_dir = Path(sweep_dir).resolve()
    records, notes = load_sweep(sweep_dir)
    report = compare_records(records, notes, sweep_dir=str(sweep_dir))
    if write:
        explain.write_plot(report, sweep_dir)  # explain.png, named in each group's section
        write_outputs(report, sweep_dir)
    return report, render(report)
