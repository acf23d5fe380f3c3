"""The comparison for people: Markdown (printed and comparison.md) and the per-step picture.

The report dict comes from `comparison.compare_records`; nothing here computes a number.
"""

from __future__ import annotations

import json
from pathlib import Path

from moe_perf.report import explain
from moe_perf.report.record import ARMS

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
        missing = [a for a in ARMS if not group["arms"].get(a, {}).get("runs_ok")]
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
        lines += _group_lines(group) + explain.markdown(group) + [""]
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
