"""explain's section for people: the Markdown under each group of comparison.md, and the
picture of the category deltas (explain.png). The numbers come from report/explain/; nothing
here computes one."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moe_perf.report import figures
from moe_perf.report.explain.categories import EXPERT_SCOPE
from moe_perf.report.explain.noise import noise_floor
from moe_perf.report.results.comparison import Comparison, Difference, Group


def _ms(value: float | None, sign: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.3f}" if sign else f"{value:.3f}"


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown(section: Mapping[str, Any] | None, step_time: Difference | None = None) -> list[str]:
    """A group's explain section in Markdown lines ([] if it has none); `step_time`: the
    group's measured step-time difference, shown beside the memory."""
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
    lines += _memory_lines(section, step_time)
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


def _memory_lines(section: Mapping[str, Any], step_time: Difference | None) -> list[str]:
    memory = section["memory"]
    if not memory:
        return []
    change = f"{step_time.pct:+.2f}%" if step_time else "-"
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


def _broken_down(group: Group) -> bool:
    return bool((group.explain or {}).get("categories"))


def plot(report: Comparison, path: Path) -> Path | None:
    """A bar chart of the category deltas (feat - base, ms/step), one panel per group."""
    groups = [g for g in report.groups if _broken_down(g)]
    if not groups:
        return None
    fig, axes = figures.pyplot().subplots(
        len(groups), 1, figsize=(8, 3.6 * len(groups)), squeeze=False
    )
    for ax, group in zip(axes[:, 0], groups, strict=True):
        rows = [r for r in group.explain["categories"] if r["base_ms"] or r["feat_ms"]]
        labels = [r["label"] for r in rows]
        deltas = [r["delta_ms"] for r in rows]
        noise = [r["noise_ms"] or 0.0 for r in rows]
        colours = ["tab:orange" if r["beyond_noise"] else "tab:gray" for r in rows]
        ax.barh(labels, deltas, xerr=noise, color=colours, ecolor="black", capsize=3)
        ax.axvline(0, color="black", linewidth=0.8)
        ax.invert_yaxis()
        ax.set_xlabel("feat - base, ms per profiled step (error bar: noise)")
        ax.set_title(f"{group.model}  {group.tag}  (profiled steps, not measured ones)",
                     fontsize=9)  # fmt: skip
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return figures.save(fig, path)


def write_plot(report: Comparison, out_dir: Path) -> Comparison:
    """explain.png in out_dir when a group has a breakdown; the report with its name in those
    sections."""
    path = plot(report, Path(out_dir) / "explain.png")
    named = {"plot": path.name if path else None}
    return dataclasses.replace(report, groups=tuple(
        dataclasses.replace(g, explain={**g.explain, **named}) if _broken_down(g) else g
        for g in report.groups))  # fmt: skip
