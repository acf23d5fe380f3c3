"""Pairs until decided: which arms a multirun runs, in which order, and when it stops.

A multirun `-m [other sweeps] arm=base,feat` is a set of *cells*, one per combination of the
other swept values (a mesh, a model), each compared on its own. Per cell the arms run in
pairs, base and feat back to back, in the order ABBA ABBA... (pair 0 base first, pair 1 feat
first, ...), so slow drift and a second-arm bias (the second arm of a CPU A/A ran 2-6%
faster) enter the pairs' log-ratios with alternating signs and cancel in their mean.

* `repeat=auto` (the default): after each pair the cell's verdict is recomputed
  (moe_perf/stats/verdict.py); the cell stops once it is decided, at `compare.max_pairs`, or
  when `compare.max_minutes` is spent. Cells already decided get no more pairs.
* `repeat=0,1,2`: fixed repeats, every pair run, one decision at the end.
* a single arm (`arm=feat`, or no `arm` sweep): each cell runs once per repeat; nothing to
  decide.

Every arm stays one Hydra job with its own directory (`<tag>-<arm>` for pair 0 of an auto
sweep, `-r<k>` for pair k). This module is pure planning plus reading the arms' records back;
the Hydra sweeper (hydra_plugins/moe_perf_sweeper) launches what it plans.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser

from moe_perf.report import sweep as sweeps
from moe_perf.report.results.arm import ArmRecord, RecordError, Summary
from moe_perf.stats.verdict import Plan, Verdict, decide, describe, keep_adding

ARMS = ("base", "feat")
# The metric the sweep decides on; tokens/s and peak memory are reported, not waited for.
DECIDING_METRIC = "step_time_s"


@dataclass(frozen=True)
class SweepPlan:
    """What a multirun's arguments ask for."""

    cells: list[tuple[str, ...]]  # each cell's overrides, arm and repeat left out
    arms: tuple[str, ...]  # the swept arms, in the user's order
    repeats: tuple[int, ...] | None  # fixed repeat indices; None: pairs until decided

    @property
    def pairs(self) -> bool:
        return sorted(self.arms) == sorted(ARMS)

    @property
    def auto(self) -> bool:
        return self.pairs and self.repeats is None


def plan_of(arguments: Sequence[str], parser: OverridesParser | None = None) -> SweepPlan:
    """Reads the sweep's overrides (and `hydra.sweeper.params`, given as `key=values` strings).

    `arm` and `repeat` are the sweeper's own; every other override, swept or not, makes the
    cells: their cartesian product, the first override varying slowest (Hydra's basic order).
    """
    parser = parser or OverridesParser.create()
    arms: tuple[str, ...] = ("base",)
    repeats: tuple[int, ...] | None = None
    auto_asked = False
    choices: list[list[str]] = []
    for override in parser.parse_overrides(list(arguments)):
        key = override.get_key_element()
        values = _values(override)
        if key.lstrip("+~") == "arm":
            arms = tuple(values)
        elif key.lstrip("+~") == "repeat":
            if values == ["auto"]:
                auto_asked = True
            else:
                repeats = tuple(_repeat_index(v) for v in values)
        else:
            choices.append([f"{key}={v}" for v in values])
    if auto_asked and repeats is not None:
        raise ValueError("repeat=auto cannot be combined with repeat indices; give one of them")
    cells = [tuple(cell) for cell in itertools.product(*choices)]
    # one arm and no repeats: nothing to decide, each cell runs once, its directory unsuffixed
    return SweepPlan(cells=cells, arms=arms, repeats=repeats)


def _values(override) -> list[str]:
    if override.is_sweep_override():
        if not override.is_discrete_sweep():
            raise ValueError(f"{override.input_line}: moe_perf sweeps take lists (a,b,c) only")
        return [str(v) for v in override.sweep_string_iterator()]
    return [override.get_value_element_as_str()]


def _repeat_index(value: str) -> int:
    try:
        index = int(value)
    except ValueError:
        index = -1
    if index < 0:
        raise ValueError(f"repeat={value}: a repeat is auto or an index >= 0 (repeat=0,1,2)")
    return index


def job_overrides(plan: SweepPlan, cell: Sequence[str], arm: str, repeat: int) -> list[str]:
    """One job's overrides. Pair 0 of an auto sweep carries no `repeat`, so its directory is
    `<tag>-<arm>` as a single pair always was; fixed repeats always name theirs."""
    extra = [f"repeat={repeat}"] if plan.repeats is not None or repeat > 0 else []
    return [*cell, f"arm={arm}", *extra]


def pair_order(index: int, arms: Sequence[str] = ARMS) -> tuple[str, ...]:
    """ABBA: pair 0 base first, pair 1 feat first, and so on."""
    ordered = tuple(sorted(arms, key=ARMS.index))
    return ordered if index % 2 == 0 else ordered[::-1]


def distinct_jobs(plan: SweepPlan) -> list[list[str]]:
    """One job per cell and arm (repeat 0): what a pre-flight of the whole sweep checks."""
    return [job_overrides(plan, cell, arm, (plan.repeats or (0,))[0])
            for cell in plan.cells for arm in plan.arms]  # fmt: skip


def fixed_batches(plan: SweepPlan) -> list[list[list[str]]]:
    """The batches of a sweep that decides nothing as it goes: per repeat, per cell, a pair in
    ABBA order (or the one arm)."""
    batches = []
    for i, repeat in enumerate(plan.repeats or (0,)):
        for cell in plan.cells:
            arms = pair_order(i, plan.arms) if plan.pairs else plan.arms
            batches.append([job_overrides(plan, cell, arm, repeat) for arm in arms])
    return batches


# ---- reading the pairs back ------------------------------------------------------------------


@dataclass
class Cell:
    """One cell of a running sweep: its pairs so far and its verdict."""

    overrides: tuple[str, ...]
    pairs: list[dict[str, Summary]] = field(default_factory=list)  # arm -> its run's summary
    failed: str | None = None  # an arm of this cell failed: why (no more pairs are added)
    verdict: Verdict | None = None
    label: str = ""  # "<model> <tag>", from the first record read

    def medians(self, metric: str) -> tuple[list[float], list[float]]:
        complete = [p for p in self.pairs if _usable(p, metric)]
        return ([p["base"].value(metric) for p in complete],
                [p["feat"].value(metric) for p in complete])  # fmt: skip


def _usable(pair: dict[str, Summary], metric: str) -> bool:
    values = [pair[arm].value(metric) if arm in pair else None for arm in ARMS]
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


def read_record(arm_dir: Path) -> ArmRecord | None:
    """The arm's metrics.json; None where it left none, or none this code reads."""
    try:
        return ArmRecord.load(Path(arm_dir) / "metrics.json")
    except RecordError:
        return None


def add_pair(cell: Cell, records: dict[str, ArmRecord | None], plan: Plan) -> Verdict | None:
    """Adds one pair's records (arm -> record, None when the arm left none) and decides."""
    summaries = {}
    for arm, record in records.items():
        if record is None or not record.ok:
            why = (record.failure if record else None) or "no record written"
            cell.failed = f"{arm} failed: {why}"
        else:
            summaries[arm] = record.summary
            cell.label = cell.label or f"{record.model} {record.tag}"
    cell.pairs.append(summaries)
    base, feat = cell.medians(DECIDING_METRIC)
    cell.verdict = decide(base, feat, plan) if base else None  # none while no pair is whole
    return cell.verdict


def wants_more(cell: Cell, plan: Plan) -> bool:
    return cell.failed is None and cell.verdict is not None and keep_adding(cell.verdict, plan)


def progress_line(cell: Cell, plan: Plan, sequential: bool, stopping: str | None = None) -> str:
    """What the console says after each pair: estimate, interval, word, what it waits for."""
    where = cell.label or " ".join(cell.overrides) or "the sweep"
    head = f"{where}: after pair {len(cell.pairs)}"
    if cell.failed:
        return f"{head}: {cell.failed}; no more pairs for it"
    verdict = cell.verdict
    said = describe(verdict, "slower", "faster") if verdict else "no step times yet"
    if not sequential:
        return f"{head} of {plan.max_pairs} (fixed repeats): {said}"
    if stopping:
        return f"{head}: {said}; stopped: {stopping}"
    if verdict and not keep_adding(verdict, plan):
        done = "decided" if verdict.word != "UNKNOWN" else f"compare.max_pairs={plan.max_pairs}"
        return f"{head}: {said}; done ({done})"
    return f"{head}: {said}; running pair {len(cell.pairs) + 1} (at most {plan.max_pairs})"


def dry_run_note(sweep_plan: SweepPlan, plan: Plan) -> str:
    cells = len(sweep_plan.cells)
    if not sweep_plan.pairs:
        return f"dry run: {cells} cell(s), one arm each, nothing to decide"
    if sweep_plan.auto:
        return (
            f"dry run: {cells} cell(s); each runs base/feat pairs in ABBA order until its "
            f"step-time verdict is decided, at most compare.max_pairs={plan.max_pairs} "
            f"pairs; each pair runs the two commands above (repeat=<k> from pair 2 on)"
        )
    return (f"dry run: {cells} cell(s) x {len(sweep_plan.repeats or ())} fixed pair(s) in ABBA "
            f"order, decided once at the end")  # fmt: skip


def save_plan(sweep_dir: Path, plan: Plan, sweep_plan: SweepPlan, cells: Iterable[Cell]) -> None:
    """The plan the comparison reads back (report/sweep.py): the verdict at the end is
    computed exactly as the sweep computed it while running."""
    sweeps.save_plan(sweep_dir, {
        "schema": "moe_perf.plan/1",
        "mode": "auto" if sweep_plan.auto else "fixed",
        "plan": asdict(plan),
        "cells": [{"overrides": list(c.overrides), "pairs": len(c.pairs), "failed": c.failed,
                   "verdict": c.verdict.to_dict() if c.verdict else None} for c in cells],
    })  # fmt: skip


def plan_from_config(compare: Any, sequential: bool, max_pairs: int | None = None) -> Plan:
    """The decision plan from the `compare` config section."""
    return Plan(
        effect=float(compare.effect),
        confidence=float(compare.confidence),
        max_pairs=int(max_pairs if max_pairs is not None else compare.max_pairs),
        sequential=sequential,
    )


# ---- running them ----------------------------------------------------------------------------

# launch(batch of job overrides) -> each job's arm directory (None where the job left none)
Launch = Any


@dataclass
class PairSweep:
    """Runs a SweepPlan through `launch`, deciding as it goes; says each step with `say`."""

    sweep_plan: SweepPlan
    plan: Plan
    launch: Launch
    say: Any
    sweep_dir: Path
    max_minutes: float | None = None
    clock: Any = None
    cells: list[Cell] = field(default_factory=list)

    def __post_init__(self) -> None:
        import time

        self.clock = self.clock or time.monotonic
        self.cells = [Cell(tuple(c)) for c in self.sweep_plan.cells]
        self.started = self.clock()

    def run(self) -> list[Cell]:
        save_plan(self.sweep_dir, self.plan, self.sweep_plan, self.cells)
        if not self.sweep_plan.pairs:
            for batch in fixed_batches(self.sweep_plan):
                self.launch(batch)
        elif self.sweep_plan.auto:
            self._until_decided()
        else:
            self._fixed_pairs()
        return self.cells

    def _pair(self, cell: Cell, index: int, repeat: int) -> None:
        arms = pair_order(index)
        dirs = self.launch([job_overrides(self.sweep_plan, cell.overrides, a, repeat)
                            for a in arms])  # fmt: skip
        add_pair(
            cell,
            {a: read_record(d) if d else None for a, d in zip(arms, dirs, strict=True)},
            self.plan,
        )
        save_plan(self.sweep_dir, self.plan, self.sweep_plan, self.cells)

    def _fixed_pairs(self) -> None:
        for index, repeat in enumerate(self.sweep_plan.repeats or (0,)):
            for cell in self.cells:
                self._pair(cell, index, repeat)
                self.say(progress_line(cell, self.plan, sequential=False))

    def _until_decided(self) -> None:
        for index in range(self.plan.max_pairs):
            for cell in self.cells:
                if index > 0 and not wants_more(cell, self.plan):
                    continue
                spent = self._time_spent()
                if index > 0 and spent:
                    self.say(progress_line(cell, self.plan, True, spent))
                    continue
                self._pair(cell, index, index)
                self.say(progress_line(cell, self.plan, sequential=True))

    def _time_spent(self) -> str | None:
        if self.max_minutes is None:
            return None
        minutes = (self.clock() - self.started) / 60
        if minutes < self.max_minutes:
            return None
        return f"compare.max_minutes={self.max_minutes:g} spent ({minutes:.1f} min)"
