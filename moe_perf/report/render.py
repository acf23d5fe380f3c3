"""The comparison for people: Markdown (printed and comparison.md) and the per-step picture.

The Comparison comes from `comparison.compare_records` (or Comparison.load); nothing here
computes a number.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from moe_perf.report import figures, imbalance, render_explain
from moe_perf.report.colours import arm_colour
from moe_perf.report.record import ARMS
from moe_perf.report.results.comparison import ArmFigures, Comparison, Difference, Group, Spread
from moe_perf.stats.verdict import describe

# ---- rendering -------------------------------------------------------------------------------

_COLUMNS = (  # metric, header, format
    ("step_time_s", "step time (s)", "{:.4f}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("peak_mem_gib", "peak mem (GiB)", "{:.2f}"),
    ("tflops", "TFLOP/s", "{:.4g}"),
    ("mfu", "MFU", "{:.3f}"),
)


def _cell(stat: Spread | None, fmt: str, runs_ok: int) -> str:
    if not stat:
        return "-"
    text = fmt.format(stat.median)
    if runs_ok > 1:  # the run-to-run spread, only meaningful with repeats
        text += f" [{fmt.format(stat.min)}-{fmt.format(stat.max)}]"
    return text


def _commit(arm: ArmFigures) -> str:
    shas = ", ".join(s[:12] for s in arm.shas) or "-"
    return f"{', '.join(arm.refs)} @ {shas}" if arm.refs else shas


def _table(group: Group) -> list[str]:
    columns = [c for c in _COLUMNS if any(a.figures.get(c[0]) for a in group.arms.values())]
    columns = columns or list(_COLUMNS[:3])
    head = ["arm", "runs", *(c[1] for c in columns), "commit"]
    rows = [head, ["---"] * len(head)]
    for name, arm in group.arms.items():
        failed = arm.runs_failed
        runs = str(arm.runs_ok) + (f" ({failed} failed)" if failed else "")
        if not arm.runs_ok:
            runs = "failed" + (f" ({arm.runs_failed})" if arm.runs_failed > 1 else "")
        cells = [_cell(arm.figures.get(key), fmt, arm.runs_ok) for key, _, fmt in columns]
        rows.append([name, runs, *cells, _commit(arm)])
    if group.difference:
        diffs = []
        for key, _, _ in columns:
            d = group.difference.get(key)
            diffs.append(f"{d.pct:+.2f}% ({d.words})" if d else "-")
        rows.append(["feat vs base", "", *diffs, ""])
    return ["| " + " | ".join(row) + " |" for row in rows]


# metric, its name, the words for feat's value above / below base's
_VERDICT_METRICS = (
    ("step_time_s", "Step time", "slower", "faster"),
    ("tokens_per_s", "Tokens/s", "faster", "slower"),
    ("peak_mem_gib", "Peak memory", "more memory", "less memory"),
)


def verdict_sentence(group: Group, key: str = "step_time_s") -> str | None:
    """The group's verdict on one metric in one sentence, or None when it has none."""
    found = (group.verdict or {}).get(key)
    if not found:
        return None
    _, _, more, less = next(m for m in _VERDICT_METRICS if m[0] == key)
    return describe(found, more, less)


def _verdict_lines(group: Group) -> list[str]:
    plan = group.plan
    if not group.verdict or not plan:
        return []
    how = "pairs added until decided" if plan["sequential"] else "fixed repeats, one look"
    lines = [f"Verdict from {group.pairs} base/feat pair(s) of run medians (effect "
             f"{plan['effect']:.1%}, confidence {plan['confidence']:.0%}, {how}; "
             f"peak memory within {plan['memory_tolerance']:.1%} is the same):", ""]  # fmt: skip
    for key, name, _, _ in _VERDICT_METRICS:
        sentence = verdict_sentence(group, key)
        if sentence:
            lines.append(f"- **{name}**: {sentence}")
    if group.unsettled_runs:
        runs = ", ".join(group.unsettled_runs)
        lines.append(f"- Note: {runs} never settled (below); the verdict uses their medians "
                     "all the same: more steps (training.max_steps) would settle them")  # fmt: skip
    return lines


def _missing(group: Group) -> list[str]:
    """The arms without a successful run."""
    return [a for a in ARMS if a not in group.arms or not group.arms[a].runs_ok]


def _run_lines(group: Group) -> list[str]:
    lines = []
    for run in group.runs:
        name = f"{run.arm} r{run.repeat}"
        if not run.ok:
            why = run.failure or f"exit code {run.exit_code}"
            lines.append(f"- {name} FAILED: {why}; log: {run.log}")
        elif run.unstable:
            lines.append(f"- Warning: {name} {run.unstable}")
        if run.ok and run.unsettled:
            lines.append(f"- Warning: {name} {run.unsettled}")
    return lines


def _group_lines(group: Group) -> list[str]:
    lines = [f"## {group.model}  {group.tag}", ""]
    if group.aa:
        sha = group.arms["base"].shas[0][:12]
        lines += [f"A/A run: base and feat are the same commit {sha}; any difference is noise.", ""]
    warnings = group.import_warnings  # both arms ran one file of the module
    lines += [f"**Warning**: {w}." for w in warnings] + ([""] if warnings else [])
    if group.status == "refused":
        lines.append("Comparison refused: the arms' resolved configs differ (besides arm/repeat):")
        for diff in group.config_differences:
            values = ", ".join(f"{k}={v!r}" for k, v in diff["values"].items())
            lines.append(f"- `{diff['key']}`: {values}")
        lines.append("")
    lines += _table(group) + [""]
    lines += [f"Note: {note}." for note in group.environment_differences]
    lines += [""] if group.environment_differences else []
    verdict_lines = _verdict_lines(group)
    if verdict_lines:
        lines += verdict_lines + [""]
    if group.status == "incomplete":
        lines += [f"No difference computed: no successful run of {', '.join(_missing(group))}.",
                  ""]  # fmt: skip
    return lines + _run_lines(group)


def render(report: Comparison) -> str:
    """The comparison as Markdown: what is printed and what comparison.md holds."""
    lines = ["# moe_perf comparison", ""]
    if report.sweep_dir:
        lines += [f"Sweep: {report.sweep_dir}", ""]
    lines += [f"Note: {note}" for note in report.notes] + ([""] if report.notes else [])
    if not report.groups:
        lines.append("No arm records (metrics.json) found.")
    for group in report.groups:
        explained = render_explain.markdown(group.explain, group.difference.get("step_time_s"))
        lines += _group_lines(group) + explained + imbalance.markdown(group.routing) + [""]
    return "\n".join(lines).rstrip() + "\n"


# ---- the verdict -----------------------------------------------------------------------------


def _how_much(d: Difference, metric_words: str = "") -> str:
    """`2.96% slower than` / `the same speed as`: feat against base, in words."""
    if d.words == "same":
        return "the same as"
    return f"{abs(d.pct):.2f}% {d.words}{metric_words} than"


def _verdict_words(group: Group) -> str:
    """The verdict without the group's name: what `verdict` and the picture's title say."""
    runs = group.runs
    failed = sum(not r.ok for r in runs)
    tail = f" ({failed} of {len(runs)} runs failed)" if failed else ""
    if group.status == "refused":
        keys = ", ".join(d["key"] for d in group.config_differences)
        return f"not compared, the arms' resolved configs differ ({keys})"
    if group.status == "incomplete":
        return f"not compared, no successful run of {', '.join(_missing(group))}{tail}"
    sentence = verdict_sentence(group)
    if sentence:
        return f"step time {sentence}{tail}"
    d = group.difference.get("step_time_s")
    if not d:
        return f"no step times to compare{tail}"
    return f"feat is {_how_much(d)} base (no base/feat pair to decide from){tail}"


def verdict(group: Group) -> str:
    """One line per (model, tag): `tiny pp1-...: step time 2.1% slower (95% CI ...): DIFFERENT`
    (the verdict's sentence, moe_perf/stats/verdict.py)."""
    text = f"{group.model} {group.tag}: {_verdict_words(group)}"
    if group.aa:
        text += "; A/A run (one commit), so any difference is noise"
    return text


# ---- the picture -----------------------------------------------------------------------------

_REPEAT_MARKERS = "os^Dv<>PX*"


def _figure(value: float) -> str:
    """`45,480` or `0.2208`: whole numbers above a thousand, four significant digits below."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _title(group: Group) -> str:
    head = f"{group.model}  {group.tag}"
    if group.aa:
        head += "  A/A run: base and feat are one commit, any difference is noise"
    return f"{head}\nstep time: {_verdict_words(group)}"


def _draw_steps(ax, group: Group) -> None:
    """Every run's step times (first step left out), each arm's median and its spread."""
    for run in group.runs:
        points = [(s, t) for s, t in run.step_times[1:] if t is not None]
        label = f"{run.arm} r{run.repeat}" + ("" if run.ok else " FAILED")
        marker = _REPEAT_MARKERS[int(run.repeat or 0) % len(_REPEAT_MARKERS)]
        if not points:
            ax.plot([], [], color=arm_colour(run.arm), marker="x", ls="none",
                    label=label + " (no steps)")  # fmt: skip
            continue
        xs, ys = zip(*points, strict=True)
        style = {"marker": marker, "ls": "-", "alpha": 0.75} if run.ok else {
            "marker": "x", "ls": ":", "alpha": 0.5}  # fmt: skip
        ax.plot(xs, ys, color=arm_colour(run.arm), ms=5, lw=1, label=label, **style)
    for name, arm in group.arms.items():
        stat = arm.figures.get("step_time_s")
        if not stat:
            continue
        colour = arm_colour(name)
        ax.axhline(stat.median, color=colour, lw=2.2, alpha=0.9,
                   label=f"{name} median {stat.median:.4g} s")  # fmt: skip
        if arm.runs_ok > 1:
            ax.axhspan(stat.min, stat.max, color=colour, alpha=0.15,
                       label=f"{name} spread of {arm.runs_ok} runs")  # fmt: skip
    ax.xaxis.get_major_locator().set_params(integer=True)  # steps are whole numbers
    ax.set_xlabel("step (step 1 not shown: warm-up)")
    ax.set_ylabel("step time (s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def _draw_per_arm(ax, group: Group, key: str, label: str) -> None:
    """One bar per arm at its median (of run medians), every run as a dot, failures named."""
    names = list(group.arms)
    for i, name in enumerate(names):
        arm, colour = group.arms[name], arm_colour(name)
        stat = arm.figures.get(key)
        if stat:
            ax.bar(i, stat.median, color=colour, alpha=0.45, width=0.6)
            ax.text(i, stat.median / 2, _figure(stat.median), ha="center", va="center",
                    fontsize=7)  # fmt: skip
        else:
            ax.text(i, 0, "failed" if arm.runs_failed else "-", ha="center", va="bottom",
                    fontsize=8, color="tab:red")  # fmt: skip
        for run in group.runs:
            value = run.summary.value(key) if run.arm == name else None
            if value is not None and run.ok:
                marker = _REPEAT_MARKERS[int(run.repeat or 0) % len(_REPEAT_MARKERS)]
                ax.plot(i, value, marker=marker, color=colour, ms=5, mec="black", mew=0.5)
    ax.set_xticks(range(len(names)), names)
    ax.set_xlim(-0.6, len(names) - 0.4)
    d = group.difference.get(key)
    ax.set_title(label + (f"\nfeat {d.pct:+.2f}%" if d else ""), fontsize=8)
    ax.grid(alpha=0.3, axis="y")


def figure(report: Comparison):
    """One row per (model, tag): every run's step times with each arm's median and spread,
    then tokens/s and peak memory per arm. None if no run has a step to draw."""
    groups = report.groups
    if not any(r.step_times for g in groups for r in g.runs):
        return None
    plt = figures.pyplot()
    fig, axes = plt.subplots(len(groups), 3, figsize=(13, 3.8 * len(groups)), squeeze=False,
                             width_ratios=[3.2, 1, 1], layout="constrained")  # fmt: skip
    for row, group in zip(axes, groups, strict=True):
        _draw_steps(row[0], group)
        row[0].set_title(_title(group), fontsize=9, loc="left")
        _draw_per_arm(row[1], group, "tokens_per_s", "tokens/s (median of runs)")
        _draw_per_arm(row[2], group, "peak_mem_gib", "peak memory GiB (max per run)")
    return fig


def plot(report: Comparison, path: Path) -> Path | None:
    """The figure saved at `path` (PNG, 100 dpi); None, and no file, if there is nothing to draw."""
    fig = figure(report)
    return figures.save(fig, path) if fig is not None else None


def write_outputs(report: Comparison, out_dir: Path) -> Comparison:
    """comparison.json, comparison.md and comparison.png (where there is a step to draw) in
    out_dir; the report as written, naming the files beside it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot(report, out_dir / "comparison.png")
    files = {"markdown": "comparison.md", "plot": png.name if png else None}
    written = dataclasses.replace(report, files=files)
    written.dump(out_dir / "comparison.json")  # strict JSON, no NaN
    (out_dir / "comparison.md").write_text(render(written))
    return written
