"""Routing in the comparison: the imbalance asked for against the one measured, and step time
against imbalance.

With routing other than balanced (docs/routing.md) each (model, tag) group gets a `routing`
section: what was asked (`routing.*`), what the skew plan makes of it in whole slot counts
(common/routing.py), and what each arm measured: the reference trainer's per-step
`expert_imbalance` and `rank_imbalance` (the busiest expert's and the busiest rank's slots over
the mean), the median of a run's measured steps, then the median and min-max over its runs.

A sweep over the imbalance (`routing=skew -m routing.imbalance=1,1.5,2,4 arm=base,feat`) makes
one group per imbalance (the tag names it); `figure` draws, one row per such sweep, each arm's
step time and tokens/s against the requested imbalance with the run-to-run spread shaded
(comparison_imbalance.png, drawn like comparison.png: report/render.py).

Hooks: comparison.compare_group (`routing_section`), comparison.compare_sweep (`write_plot`),
render.render (`markdown`).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from moe_perf.common.config import ConfigError, config_from_dict, skew_plan_of
from moe_perf.common.routing import RoutingError, imbalance_text
from moe_perf.report import figures
from moe_perf.report.colours import arm_colour
from moe_perf.report.results.arm import IMBALANCE_METRICS, ArmRecord
from moe_perf.report.results.comparison import Comparison, Group, Run

PLOT_NAME = "comparison_imbalance.png"
# a measured imbalance equals the plan's when within this (relative): the contract line
# prints 6 significant digits
SAME = 1e-4
_LABELS = {"expert_imbalance": "busiest expert / mean", "rank_imbalance": "busiest rank / mean"}


# ---- the section -----------------------------------------------------------------------------


def _routing_config(records: list[ArmRecord]) -> dict | None:
    """The group's routing section (the arms' configs are identical but for arm/repeat)."""
    for record in records:
        routing = record.section("routing")
        if isinstance(routing, dict):
            return routing
    return None


def planned(config: dict) -> dict | None:
    """The skew plan's imbalances for a resolved config; None when it has none."""
    try:
        cfg = config_from_dict(config)
        plan = skew_plan_of(cfg.routing, cfg.model, cfg.mesh_dims, cfg.training)
    except (ConfigError, RoutingError, KeyError, TypeError, ValueError):
        return None
    return {"expert_imbalance": plan.expert_imbalance, "rank_imbalance": plan.rank_imbalance}


def _stat(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def achieved(runs: Sequence[Run], arm: str) -> dict:
    """An arm's measured imbalances over its successful runs (run medians)."""
    ok = [r for r in runs if r.arm == arm and r.ok]
    entry: dict = {"runs": len(ok)}
    for key in IMBALANCE_METRICS:
        entry[key] = _stat([r.summary.value(key) for r in ok if r.summary.value(key) is not None])
    return entry


def _matches(plan: dict | None, runs: Sequence[Run]) -> bool | None:
    """Whether every successful run measured the planned imbalances; None when unknown."""
    measured = [r.summary for r in runs if r.ok]
    pairs = [(s.value(k), plan[k]) for s in measured for k in IMBALANCE_METRICS] if plan else []
    pairs = [(got, want) for got, want in pairs if got is not None]
    if not pairs:
        return None
    return all(abs(got - want) <= SAME * want for got, want in pairs)


def routing_section(runs: Sequence[Run], arms: Iterable[str],
                    records: list[ArmRecord]) -> dict | None:  # fmt: skip
    """A group's routing section from its runs, its arms and their records; None under balanced
    routing (or no routing config)."""
    routing = _routing_config(records)
    if routing is None or routing.get("mode", "balanced") == "balanced":
        return None
    mode = routing["mode"]
    config = next((r.config for r in records if r.config), {})
    plan = planned(config) if mode == "skew" else None
    keys = ("imbalance", "shape", "hot_experts", "hot_ranks") if mode == "skew" else ()
    return {
        "mode": mode,
        "requested": {k: routing.get(k) for k in keys},
        "planned": plan,
        "achieved": {arm: achieved(runs, arm) for arm in arms},
        "matches_plan": _matches(plan, runs),
    }


# ---- Markdown --------------------------------------------------------------------------------


def _value(stat: dict | None, runs: int) -> str:
    if not stat:
        return "not reported"
    text = f"{stat['median']:.4g}"
    return text + (f" [{stat['min']:.4g}-{stat['max']:.4g}]" if runs > 1 else "")


def _heading(section: dict) -> str:
    if section["mode"] == "real":
        return "### Routing: real (the router's own top-k, seeded)"
    r = section["requested"]
    hot = f", {r['hot_experts']} hot expert(s)" if r.get("shape") == "hot" else ""
    return (f"### Routing: skew (imbalance {imbalance_text(float(r['imbalance']))}, shape "
            f"{r['shape']}{hot}, hot experts on {r['hot_ranks']} EP rank(s))")  # fmt: skip


def _rows(section: dict) -> list[str]:
    rows = []
    if section["mode"] == "skew":
        requested = imbalance_text(float(section["requested"]["imbalance"]))
        rows.append(f"| requested | {requested} | - |")
        plan = section["planned"]
        if plan:
            rows.append(f"| planned (whole slot counts) | {plan['expert_imbalance']:.4g} | "
                        f"{plan['rank_imbalance']:.4g} |")  # fmt: skip
    for arm, got in section["achieved"].items():
        cells = [_value(got[k], got["runs"]) for k in IMBALANCE_METRICS]
        rows.append(f"| {arm}, measured | {' | '.join(cells)} |")
    return rows


def _sentences(section: dict) -> list[str]:
    lines = []
    if section["matches_plan"] is True:
        lines.append("Every run measured exactly the planned imbalance.")
    elif section["matches_plan"] is False:
        lines.append("Warning: a run measured another imbalance than the plan's.")
    if all(not got[k] for got in section["achieved"].values() for k in IMBALANCE_METRICS):
        lines.append("This trainer prints no per-step expert counts (the reference trainer "
                     "does): the imbalance it ran is the plan's, not measured.")  # fmt: skip
    if section["mode"] == "real":
        lines.append("Under the router's own choice the counts move from step to step, and the "
                     "step times with them: compare with repeats (-m repeat=0,1,2 "
                     "arm=base,feat).")  # fmt: skip
    if section.get("plot"):
        lines.append(f"Step time against imbalance: {section['plot']}.")
    return lines


def markdown(section: Mapping[str, Any] | None) -> list[str]:
    """A group's routing section in Markdown lines ([] if it has none)."""
    if not section:
        return []
    lines = ["", _heading(section), ""]
    lines += ["| | busiest expert / mean | busiest EP rank / mean |", "|---|---:|---:|"]
    lines += _rows(section) + [""]
    sentences = _sentences(section)
    return lines + ([" ".join(sentences), ""] if sentences else [])


# ---- step time against imbalance -------------------------------------------------------------


def sweeps(report: Comparison) -> dict[tuple[str, str], list[Group]]:
    """{(model, tag with the imbalance as `*`): its skew groups by requested imbalance} for
    every sweep over routing.imbalance with two or more imbalances measured."""
    found: dict[tuple[str, str], list[Group]] = {}
    for group in report.groups:
        section = group.routing or {}
        if section.get("mode") != "skew":
            continue
        r = imbalance_text(float(section["requested"]["imbalance"]))
        family = group.tag.replace(f"-skew{r}", "-skew*", 1)
        found.setdefault((group.model, family), []).append(group)
    return {
        key: sorted(groups, key=_requested)
        for key, groups in found.items()
        if len({_requested(g) for g in groups}) > 1
    }


def _requested(group: Group) -> float:
    return float(group.routing["requested"]["imbalance"])


def _draw(ax, groups: list[Group], key: str, label: str) -> None:
    """Each arm's median (of run medians) against the requested imbalance, its min-max
    spread over runs shaded."""
    arms = sorted({a for g in groups for a in g.arms}, key=lambda a: (a != "base", a))
    for arm in arms:
        points = [(_requested(g), g.arms[arm].figures.get(key), g.arms[arm].runs_ok)
                  for g in groups if arm in g.arms]  # fmt: skip
        points = [(x, stat, n) for x, stat, n in points if stat]
        if not points:
            continue
        xs = [x for x, _, _ in points]
        runs = max(n for _, _, n in points)
        ax.plot(xs, [s.median for _, s, _ in points], marker="o", color=arm_colour(arm),
                label=f"{arm} (median of {runs} run(s))" if runs > 1 else arm)  # fmt: skip
        if runs > 1:
            ax.fill_between(xs, [s.min for _, s, _ in points],
                            [s.max for _, s, _ in points], color=arm_colour(arm),
                            alpha=0.15, label=f"{arm} min-max of runs")  # fmt: skip
    ax.set_xticks(sorted({_requested(g) for g in groups}))
    ax.set_xlabel("routing.imbalance (busiest expert / mean)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def figure(report: Comparison):
    """The figure of every sweep over the imbalance (one row each: step time, tokens/s), or
    None when the report has none."""
    found = sweeps(report)
    if not found:
        return None
    plt = figures.pyplot()
    fig, axes = plt.subplots(len(found), 2, figsize=(11, 3.8 * len(found)), squeeze=False,
                             layout="constrained")  # fmt: skip
    for row, ((model, family), groups) in zip(axes, found.items(), strict=True):
        _draw(row[0], groups, "step_time_s", "step time (s)")
        _draw(row[1], groups, "tokens_per_s", "tokens/s")
        # the row's (model, tag) over its left panel; each panel's y label names its metric
        row[0].set_title(f"{model}  {family}", fontsize=9, loc="left")
    return fig


def write_plot(report: Comparison, out_dir: Path) -> Comparison:
    """comparison_imbalance.png in out_dir when the report holds a sweep over the imbalance;
    the report with its name in the routing sections of the groups drawn."""
    fig = figure(report)
    if fig is None:
        return report
    figures.save(fig, Path(out_dir) / PLOT_NAME)
    drawn = {(g.model, g.tag) for groups in sweeps(report).values() for g in groups}
    return dataclasses.replace(report, groups=tuple(
        dataclasses.replace(g, routing={**g.routing, "plot": PLOT_NAME})
        if (g.model, g.tag) in drawn else g for g in report.groups))  # fmt: skip
