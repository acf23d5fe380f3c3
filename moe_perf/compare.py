"""Compare the arms of a sweep: tables, comparison.json / comparison.md, a per-step plot.

    python -m moe_perf.compare SWEEP_DIR            re-print (and re-write) a sweep's comparison
    python -m moe_perf.compare BASE FEAT            two console logs or metrics.json files
    python -m moe_perf.compare BASE FEAT --format titan --tokens-per-step 8192

It measures; it does not judge: no pass/fail, no thresholds on the difference. Honest
measurement, as pyperf does it: the first step (warm-up, compilation) is dropped, a run is
summarized by its medians, steps are never pooled across runs (with repeats an arm is the
median of its run medians, with the min-max spread of those), and a run whose step times
spread widely is called unstable in plain words.

The one summary rule, `summarize(steps)`, lives in records.py (metrics.json): a run read from
a console log here is summarized exactly as the runner summarizes an arm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

from moe_perf import logparse
from moe_perf.records import measured_steps, summarize

SCHEMA = "moe_perf.comparison/1"
ARM_SCHEMA = "moe_perf.arm/1"
METRICS = ("step_time_s", "tokens_per_s", "peak_mem_gib", "tflops", "mfu")
# A run is called unstable when its step times (first step dropped) span more than this
# fraction of their median. Plain max-min rather than a standard deviation: with 7 steps one
# straggler is exactly what we want to see.
UNSTABLE_SPREAD = 0.20
MIN_STEPS_TO_JUDGE = 3
IGNORED_CONFIG_KEYS = ("arm", "repeat")  # everything else must be identical across arms
ARM_ORDER = ("base", "feat")


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


def _read_record(path: Path) -> tuple[dict | None, str | None]:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        return None, f"skipped {path}: unreadable ({exc})"
    schema = record.get("schema") if isinstance(record, dict) else None
    if not isinstance(schema, str) or not schema.startswith("moe_perf.arm/"):
        return None, f"skipped {path}: schema {schema!r} is not {ARM_SCHEMA}"
    record["_path"] = str(path)
    return record, None


# Written by the runner (moe_perf/sweep.py) when a sweep starts; names the current sweep_id.
SWEEP_STATE = Path(".moe_perf") / "sweep.json"


def current_sweep_id(sweep_dir: Path) -> str | None:
    try:
        return json.loads((sweep_dir / SWEEP_STATE).read_text(encoding="utf-8")).get("sweep_id")
    except (OSError, ValueError, AttributeError):
        return None


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
        record, note = _read_record(path)
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


def record_from_log(path: Path, arm: str, fmt: str = "auto", **options) -> dict:
    """An arm record (schema moe_perf.arm/1, the fields a comparison needs) from a console log."""
    steps, used, env = logparse.parse_log(path, fmt, **options)
    return {
        "schema": ARM_SCHEMA,
        "model": "-",
        "tag": "-",
        "arm": arm,
        "repeat": 0,
        "ref": None,
        "sha": None,
        "status": "ok" if steps else "failed",
        "failure": None if steps else f"no per-step lines ({used} format) in the log",
        "log": str(Path(path).resolve()),
        "steps": steps,
        "summary": summarize(steps),
        "environment": env,
        "log_format": used,
        "_path": str(path),
    }


def load_arm(path: Path, arm: str, fmt: str = "auto", **options) -> dict:
    """A metrics.json file as it is, or a console log parsed into a record."""
    if path.suffix == ".json":
        record, note = _read_record(path)
        if record is None:
            raise ValueError(note)
        record["arm"] = arm
        return record
    return record_from_log(path, arm, fmt, **options)


# ---- comparing -------------------------------------------------------------------------------


def _flatten(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def config_differences(records: list[dict]) -> list[dict]:
    """Keys whose values differ between the records' configs (arm and repeat excepted)."""
    flats = []
    for record in records:
        config = {k: v for k, v in (record.get("config") or {}).items()}
        for key in IGNORED_CONFIG_KEYS:
            config.pop(key, None)
        label = f"{record.get('arm')}-r{record.get('repeat', 0)}"
        flats.append((label, _flatten(config)))
    keys = sorted(set().union(*(flat for _, flat in flats))) if flats else []
    differences = []
    for key in keys:
        values = {label: flat.get(key, "<missing>") for label, flat in flats}
        if len({json.dumps(v, sort_keys=True, default=str) for v in values.values()}) > 1:
            differences.append({"key": key, "values": values})
    return differences


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
    return group


def _arm_rank(arm: str | None) -> int:
    return ARM_ORDER.index(arm) if arm in ARM_ORDER else len(ARM_ORDER)


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


# ---- rendering -------------------------------------------------------------------------------

_COLUMNS = (  # metric, header, format
    ("step_time_s", "step time (s)", "{:.4f}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("peak_mem_gib", "peak mem (GiB)", "{:.2f}"),
    ("tflops", "TFLOP/s", "{:.4g}"),
    ("mfu", "MFU", "{:.3f}"),
)


def _cell(stat: dict | None, fmt: str, runs_ok: int) -> str:
    if not stat:
        return "-"
    text = fmt.format(stat["median"])
    if runs_ok > 1:  # the run-to-run spread, only meaningful with repeats
        text += f" [{fmt.format(stat['min'])}-{fmt.format(stat['max'])}]"
    return text


def _commit(arm: dict) -> str:
    shas = ", ".join(s[:12] for s in arm["shas"]) or "-"
    return f"{', '.join(arm['refs'])} @ {shas}" if arm["refs"] else shas


def _table(group: dict) -> list[str]:
    columns = [c for c in _COLUMNS if any(a.get(c[0]) for a in group["arms"].values())]
    columns = columns or list(_COLUMNS[:3])
    head = ["arm", "runs", *(c[1] for c in columns), "commit"]
    rows = [head, ["---"] * len(head)]
    for name, arm in group["arms"].items():
        failed = arm["runs_failed"]
        runs = str(arm["runs_ok"]) + (f" ({failed} failed)" if failed else "")
        if not arm["runs_ok"]:
            runs = "failed" + (f" ({arm['runs_failed']})" if arm["runs_failed"] > 1 else "")
        cells = [_cell(arm.get(key), fmt, arm["runs_ok"]) for key, _, fmt in columns]
        rows.append([name, runs, *cells, _commit(arm)])
    if group["difference"]:
        diffs = []
        for key, _, _ in columns:
            d = group["difference"].get(key)
            diffs.append(f"{d['pct']:+.2f}% ({d['words']})" if d else "-")
        rows.append(["feat vs base", "", *diffs, ""])
    return ["| " + " | ".join(row) + " |" for row in rows]


def _step_time_sentence(group: dict) -> str | None:
    d = group["difference"].get("step_time_s")
    if not d:
        return None
    n_base, n_feat = group["arms"]["base"]["runs_ok"], group["arms"]["feat"]["runs_ok"]
    how = f"{abs(d['pct']):.2f}% {d['words']}" if d["words"] != "same" else "the same speed"
    text = f"Step time: feat is {how} than base" if d["words"] != "same" else f"Step time: {how}"
    if n_base == 1 and n_feat == 1:
        return (
            text + " (one run per arm, first step dropped). The run-to-run spread is unknown "
            "with one run per arm: repeat the arms (e.g. -m repeat=0,1,2 arm=base,feat) to see it."
        )
    text += f" (median of {n_base} base and {n_feat} feat run medians, first step dropped). "
    if d["within_spread"]:
        return text + "The difference is within the run-to-run spread (the min-max ranges overlap)."
    if d["within_spread"] is False:
        return text + "The min-max ranges of the runs do not overlap."
    return text + "One arm has a single run, so its run-to-run spread is unknown."


def _group_lines(group: dict) -> list[str]:
    lines = [f"## {group['model']}  {group['tag']}", ""]
    if group["aa"]:
        sha = group["arms"]["base"]["shas"][0][:12]
        lines += [f"A/A run: base and feat are the same commit {sha}; any difference is noise.", ""]
    if group["status"] == "refused":
        lines.append("Comparison refused: the arms' resolved configs differ (besides arm/repeat):")
        for diff in group["config_differences"]:
            values = ", ".join(f"{k}={v!r}" for k, v in diff["values"].items())
            lines.append(f"- `{diff['key']}`: {values}")
        lines.append("")
    lines += _table(group) + [""]
    lines += [f"Note: {note}." for note in group["environment_differences"]]
    lines += [""] if group["environment_differences"] else []
    sentence = _step_time_sentence(group)
    if sentence:
        lines += [sentence, ""]
    if group["status"] == "incomplete":
        missing = [a for a in ARM_ORDER if not group["arms"].get(a, {}).get("runs_ok")]
        lines += [f"No difference computed: no successful run of {', '.join(missing)}.", ""]
    for run in group["runs"]:
        name = f"{run['arm']} r{run['repeat']}"
        if run["status"] != "ok":
            why = run["failure"] or f"exit code {run['exit_code']}"
            lines.append(f"- {name} FAILED: {why}; log: {run['log']}")
        elif run["unstable"]:
            lines.append(f"- Warning: {name} {run['unstable']}")
    return lines


def render(report: dict) -> str:
    """The comparison as Markdown: what is printed and what comparison.md holds."""
    lines = ["# moe_perf comparison", ""]
    if report.get("sweep_dir"):
        lines += [f"Sweep: {report['sweep_dir']}", ""]
    lines += [f"Note: {note}" for note in report["notes"]] + ([""] if report["notes"] else [])
    if not report["groups"]:
        lines.append("No arm records (metrics.json) found.")
    for group in report["groups"]:
        lines += _group_lines(group) + [""]
    return "\n".join(lines).rstrip() + "\n"


def plot(report: dict, path: Path) -> Path | None:
    """Per-step time, one line per run, one subplot per (model, tag); None if nothing to draw."""
    groups = [g for g in report["groups"] if any(r["step_times"] for r in g["runs"])]
    if not groups:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display on clusters; set before pyplot is imported
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(groups), 1, figsize=(8, 3.2 * len(groups)), squeeze=False)
    colours = {"base": "tab:blue", "feat": "tab:orange"}  # neutral: no good/bad colours
    for ax, group in zip(axes[:, 0], groups, strict=True):
        for run in group["runs"]:
            points = [(s, t) for s, t in run["step_times"][1:] if t is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                label = f"{run['arm']} r{run['repeat']}" + (
                    "" if run["status"] == "ok" else " (failed)"
                )
                ax.plot(xs, ys, marker="o", color=colours.get(run["arm"]), label=label, alpha=0.8)
        ax.set_title(f"{group['model']}  {group['tag']}  (first step not shown)", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("step time (s)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_outputs(report: dict, out_dir: Path) -> list[Path]:
    """comparison.json, comparison.md and comparison.png in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot(report, out_dir / "comparison.png")
    report["files"] = {"markdown": "comparison.md", "plot": png.name if png else None}
    (out_dir / "comparison.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out_dir / "comparison.md").write_text(render(report))
    return [out_dir / "comparison.json", out_dir / "comparison.md"] + ([png] if png else [])


# ---- entry points ----------------------------------------------------------------------------


def compare_sweep(sweep_dir: Path | str, write: bool = True) -> tuple[dict, str]:
    """(report, text) for a sweep directory; writes the comparison files there if `write`."""
    sweep_dir = Path(sweep_dir).resolve()
    records, notes = load_sweep(sweep_dir)
    report = compare_records(records, notes, sweep_dir=str(sweep_dir))
    if write:
        write_outputs(report, sweep_dir)
    return report, render(report)


def _short(path: Path) -> str:
    """`<arm dir>/console.log`: runner logs are all named console.log."""
    return f"{path.parent.name}/{path.name}" if path.parent.name else path.name


def compare_paths(
    base: Path, feat: Path, fmt: str = "auto", out_dir: Path | None = None, **options
) -> tuple[dict, str]:
    """(report, text) for two logs or metrics.json files, compared as one group."""
    records = [load_arm(base, "base", fmt, **options), load_arm(feat, "feat", fmt, **options)]
    keys = {(r.get("model"), r.get("tag")) for r in records}
    if len(keys) > 1 or keys == {("-", "-")}:
        for record in records:  # two files named on purpose: compare them as one group
            record["model"], record["tag"] = "files", f"{_short(base)} vs {_short(feat)}"
    notes = [f"{r['arm']}: {r['_path']} ({r.get('log_format', 'metrics.json')})" for r in records]
    report = compare_records(records, notes)
    if out_dir is not None:
        write_outputs(report, out_dir)
    return report, render(report)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m moe_perf.compare",
        description="Compare base and feat: a sweep directory, or two logs / metrics.json files.",
    )
    p.add_argument("paths", nargs="+", type=Path, help="SWEEP_DIR, or BASE FEAT")
    p.add_argument("--format", default="auto", choices=("auto", *logparse.FORMATS))
    p.add_argument("--seq-length", type=int, help="Megatron logs: tokens/s = batch*seq/time")
    p.add_argument(
        "--tokens-per-step", type=float, help="torchtitan logs: tokens per step per device"
    )
    p.add_argument("--out", type=Path, help="also write comparison.json/.md/.png here")
    p.add_argument("--no-write", action="store_true", help="SWEEP_DIR: print only")
    p.add_argument("--json", action="store_true", help="print comparison.json instead")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    options = {"seq_length": args.seq_length, "tokens_per_step": args.tokens_per_step}
    try:
        if len(args.paths) == 1 and args.paths[0].is_dir():
            report, text = compare_sweep(args.paths[0], write=not args.no_write)
        elif len(args.paths) == 2:
            base, feat = args.paths
            report, text = compare_paths(base, feat, args.format, args.out, **options)
        else:
            print("give a sweep directory, or two files: BASE FEAT", file=sys.stderr)
            return 2
    except (OSError, ValueError) as exc:
        print(f"moe_perf.compare: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2, default=str) if args.json else text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
