"""Compare the arms of a sweep: load the records, group them by (model, tag), the differences.

It measures; it does not gate: no pass/fail. Honest measurement, as pyperf does it: the
first step (warm-up, compilation) is dropped, a run is summarized by its medians, steps are
never pooled across runs (with repeats an arm is the median of its run medians, with the
min-max spread of those), and a run whose step times spread widely is called unstable in
plain words. The verdict (SAME, DIFFERENT or UNKNOWN with a confidence interval) comes from
the run medians of base/feat pairs, by moe_perf/stats/verdict.py under the sweep's plan.

The one summary rule, `Summary.of(steps)`, lives with the typed record (report/results/): a run
read from a console log here is summarized exactly as the runner summarizes an arm.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from moe_perf import logs
from moe_perf.report import imbalance, render_explain
from moe_perf.report.explain import explain_group
from moe_perf.report.imports import import_warnings
from moe_perf.report.record import ARMS, load_record
from moe_perf.report.record import config_differences as _differences
from moe_perf.report.render import render, write_outputs
from moe_perf.report.results.arm import ArmRecord, Step, Summary, settling
from moe_perf.report.results.comparison import (
    METRICS,
    SCHEMA,
    ArmFigures,
    Comparison,
    Difference,
    Group,
    Run,
    Spread,
)
from moe_perf.report.sweep import current_sweep_id, load_plan
from moe_perf.stats.verdict import MEMORY_TOLERANCE, Plan, Verdict, decide, decide_memory

# A run is called unstable when its step times (first step dropped) span more than this
# fraction of their median. Plain max-min rather than a standard deviation: with 7 steps one
# straggler is exactly what we want to see.
UNSTABLE_SPREAD = 0.20
MIN_STEPS_TO_JUDGE = 3


# ---- one run ---------------------------------------------------------------------------------


def stability_warning(steps: Sequence[Step]) -> str | None:
    """A plain sentence when the run's measured step times (step 1 and the settling steps
    dropped) spread too much to trust its median."""
    times = [s.step_time_s for s in settling(steps)[0] if s.step_time_s is not None]
    if len(times) < MIN_STEPS_TO_JUDGE:
        return f"only {len(times)} measured step(s): too few to judge stability"
    low, high, mid = min(times), max(times), statistics.median(times)
    spread = (high - low) / mid if mid > 0 else 0.0
    if spread <= UNSTABLE_SPREAD:
        return None
    settled = Summary.of(steps).steps_settling
    dropped = "first step" + (f" and {settled} settling" if settled else "")
    return (
        f"looks unstable: step times span {spread:.0%} of the median "
        f"({low:.4g}-{high:.4g} s, {dropped} dropped); its numbers are less reliable"
    )


# ---- loading ---------------------------------------------------------------------------------


def _latest_sweep(records: list[ArmRecord], current: str | None) -> list[ArmRecord]:
    """Only the records of the current sweep: the one the runner's state file names, else the
    `sweep_id` whose records were written last. (A current sweep whose arms all failed before
    writing a record must not show an earlier sweep's numbers as if they were its own.)"""
    if current is not None:
        return [r for r in records if r.sweep_id == current]
    newest: dict = {}
    for record in records:
        mtime = Path(record.path).stat().st_mtime
        newest[record.sweep_id] = max(newest.get(record.sweep_id, 0.0), mtime)
    if len(newest) <= 1:
        return records
    latest = max(newest, key=newest.get)
    return [r for r in records if r.sweep_id == latest]


def load_sweep(sweep_dir: Path) -> tuple[list[ArmRecord], list[str]]:
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
        ids = sorted({str(r.sweep_id) for r in records}) or [current_sweep_id(sweep_dir)]
        notes.append(
            f"{len(found) - len(records)} record(s) of earlier sweeps ignored; "
            f"showing sweep {', '.join(map(str, ids))}"
        )
    return records, notes


def record_from_log(path: Path, arm: str, fmt: str = "auto",
                    shape: logs.RunShape | None = None) -> ArmRecord:  # fmt: skip
    """An arm record (the fields a comparison needs) from a console log, its format detected
    (`auto`) or named, its figures normalized with the run's `shape`."""
    parsed = logs.parse_log(path, fmt, shape)
    steps, failure = tuple(Step.from_dict(s) for s in parsed.steps), parsed.failure(max_steps=0)
    return ArmRecord(
        arm=arm,
        status="ok" if failure is None else "failed",
        failure=failure,
        log=str(Path(path).resolve()),
        steps=steps,
        summary=Summary.of(steps),
        environment=parsed.env or {},
        extra={"log_format": parsed.log_format, "derivations": parsed.derivations},
        path=Path(path),
    )


def load_arm(path: Path, arm: str, fmt: str = "auto",
             shape: logs.RunShape | None = None) -> ArmRecord:  # fmt: skip
    """A metrics.json file as it is, or a console log parsed into a record."""
    if path.suffix == ".json":
        record, note = load_record(path)
        if record is None:
            raise ValueError(note)
        return dataclasses.replace(record, arm=arm)
    return record_from_log(path, arm, fmt, shape)


# ---- comparing -------------------------------------------------------------------------------


def config_differences(records: list[ArmRecord]) -> list[dict]:
    """Keys whose values differ between the records' configs (the identity rule of record.py)."""
    configs = {f"{r.arm}-r{r.repeat}": r.config or {} for r in records}
    return _differences(configs)


ENV_KEYS = ("host", "devices", "world_size", "torch", "cuda", "nccl")


def environment_differences(records: list[ArmRecord]) -> list[str]:
    """Environment fields that differ between base and feat runs: worth knowing, not a refusal
    (a cluster gives different hosts; a different GPU model or torch is another matter)."""
    notes = []
    for key in ENV_KEYS:
        seen: dict = {}
        for record in records:
            value = (record.environment or {}).get(key)
            if value is not None:
                seen.setdefault(record.arm, set()).add(json.dumps(value, sort_keys=True))
        if "base" in seen and "feat" in seen and seen["base"] != seen["feat"]:
            values = "; ".join(f"{arm}: {', '.join(sorted(v))}" for arm, v in sorted(seen.items()))
            notes.append(f"environment `{key}` differs between arms ({values})")
    return notes


def _run_entry(record: ArmRecord) -> Run:
    steps = record.steps
    summary = Summary.of(steps) if steps else record.summary
    return Run(
        arm=record.arm,
        repeat=record.repeat,
        status=record.status,
        exit_code=record.exit_code,
        failure=record.failure,
        sha=record.sha,
        ref=record.ref,
        log=record.log,
        metrics_json=str(record.path) if record.path is not None else None,
        summary=summary,
        unstable=stability_warning(steps) if record.ok else None,
        # the steady-state rule's words for a run that never settled: a verdict says so
        unsettled=summary.settling if record.ok and summary.settled is False else None,
        step_times=tuple((s.step, s.step_time_s) for s in steps),
    )


def _arm_entry(runs: list[Run]) -> ArmFigures:
    ok = [r for r in runs if r.ok]
    return ArmFigures(
        runs_ok=len(ok),
        runs_failed=len(runs) - len(ok),
        shas=tuple(sorted({r.sha for r in runs if r.sha})),
        refs=tuple(sorted({r.ref for r in runs if r.ref})),
        figures={key: Spread.of([r.summary.value(key) for r in ok
                                 if r.summary.value(key) is not None])
                 for key in METRICS},
    )  # fmt: skip


_WORDS = {  # (positive difference, negative difference), feat against base
    "step_time_s": ("slower", "faster"),
    "tokens_per_s": ("faster", "slower"),
    "peak_mem_gib": ("more memory", "less memory"),
    "tflops": ("higher", "lower"),
    "mfu": ("higher", "lower"),
}


def _difference(base: ArmFigures, feat: ArmFigures, key: str) -> Difference | None:
    b, f = base.figures.get(key), feat.figures.get(key)
    if not b or not f or not b.median:
        return None
    pct = (f.median - b.median) / b.median * 100.0
    more, less = _WORDS[key]
    words = more if pct > 0 else less if pct < 0 else "same"
    within = None  # unknown: one run per arm gives no run-to-run spread
    if base.runs_ok > 1 and feat.runs_ok > 1:
        within = b.min <= f.max and f.min <= b.max
    return Difference(pct, words, within)


# ---- the verdict -----------------------------------------------------------------------------


def paired_runs(runs: Sequence[Run]) -> list[tuple[Run, Run]]:
    """(base, feat) runs of one repeat index, both ok, in repeat order: the pairs."""
    by_repeat: dict = {}
    for run in runs:
        if run.ok:
            by_repeat.setdefault(int(run.repeat or 0), {})[run.arm] = run
    return [(p["base"], p["feat"]) for _, p in sorted(by_repeat.items()) if len(p) == 2]


def _medians(pairs: list[tuple[Run, Run]], key: str) -> tuple[list[float], list[float]]:
    usable = [(b.summary.value(key), f.summary.value(key)) for b, f in pairs]
    usable = [(b, f) for b, f in usable if _trusted(b) and _trusted(f)]
    return [b for b, _ in usable], [f for _, f in usable]


def _trusted(value) -> bool:
    return isinstance(value, (int, float)) and value == value and 0 < value < float("inf")


def _compare_section(records: list[ArmRecord]) -> dict:
    """The first record's `compare` config section ({} where none has one)."""
    return next((r.section("compare") for r in records
                 if isinstance(r.section("compare"), dict)), {})  # fmt: skip


def group_plan(records: list[ArmRecord], plan: Plan | None, pairs: int) -> Plan:
    """The sweep's plan; without one (logs, sweeps of older versions) one look at the end at
    the records' own `compare` settings."""
    if plan is not None:
        return plan
    compare = _compare_section(records)
    return Plan(effect=float(compare.get("effect", Plan.effect)),
                confidence=float(compare.get("confidence", Plan.confidence)),
                max_pairs=max(pairs, 1), sequential=False)  # fmt: skip


def memory_tolerance(records: list[ArmRecord]) -> float:
    for record in records:
        tolerance = record.section("compare", "memory_tolerance")
        if tolerance is not None:
            return float(tolerance)
    return MEMORY_TOLERANCE


def verdicts(runs: Sequence[Run], plan: Plan, tolerance: float) -> dict[str, Verdict]:
    """The verdict per metric: step time and tokens/s by the plan's interval, peak memory by
    its tolerance. Metrics no pair reported are left out."""
    pairs = paired_runs(runs)
    found = {}
    for key in ("step_time_s", "tokens_per_s"):
        base, feat = _medians(pairs, key)
        if base:
            found[key] = decide(base, feat, plan)
    base, feat = _medians(pairs, "peak_mem_gib")
    if base:
        found["peak_mem_gib"] = decide_memory(base, feat, tolerance)
    return found


def _decided(records: list[ArmRecord], runs: list[Run], arms: dict[str, ArmFigures],
             plan: Plan | None) -> dict:  # fmt: skip
    """What a compared group adds: the differences, the plan, the pairs and the verdicts."""
    pairs = paired_runs(runs)
    used = group_plan(records, plan, len(pairs))
    tolerance = memory_tolerance(records)
    return {
        "difference": {k: _difference(arms["base"], arms["feat"], k) for k in METRICS},
        "plan": {**used.__dict__, "memory_tolerance": tolerance},
        "pairs": len(pairs),
        "verdict": verdicts(runs, used, tolerance),
        # a run that never settled still counts (its median is all there is), said with the verdict
        "unsettled_runs": tuple(f"{r.arm} r{r.repeat}" for pair in pairs for r in pair
                                if r.unsettled),
    }  # fmt: skip


def _status(differences: list, arms: dict[str, ArmFigures]) -> str:
    if differences:
        return "refused"
    if any(arm not in arms or not arms[arm].runs_ok for arm in ARMS):
        return "incomplete"
    return "compared"


def compare_group(model: str, tag: str, records: list[ArmRecord],
                  plan: Plan | None = None) -> Group:  # fmt: skip
    """One (model, tag): its runs, each arm over its runs, what differs besides the code and,
    once both arms have a successful run, the differences and the verdicts."""
    runs = sorted((_run_entry(r) for r in records),
                  key=lambda r: (_arm_rank(r.arm), r.repeat or 0))  # fmt: skip
    by_arm: dict[str, list[Run]] = {}
    for run in runs:
        by_arm.setdefault(run.arm, []).append(run)
    arms = {name: _arm_entry(arm_runs) for name, arm_runs in by_arm.items()}
    differences = config_differences([r for r in records if r.config])
    shas = [set(arms[a].shas) if a in arms else set() for a in ARMS]
    status = _status(differences, arms)
    decided = _decided(records, runs, arms, plan) if status == "compared" else {"difference": {}}
    return Group(
        model=model,
        tag=tag,
        arms=arms,
        runs=tuple(runs),
        config_differences=tuple(differences),
        environment_differences=tuple(environment_differences(records)),
        import_warnings=tuple(import_warnings(records)),
        aa=bool(shas[0]) and shas[0] == shas[1] and len(shas[0]) == 1,
        status=status,
        explain=explain_group(records),  # None unless explain=true or traces exist
        routing=imbalance.routing_section(runs, arms, records),  # None: balanced routing
        **decided,
    )


def _arm_rank(arm: str | None) -> int:
    return ARMS.index(arm) if arm in ARMS else len(ARMS)


def compare_records(records: list[ArmRecord], notes: list[str] | None = None,
                    plan: Plan | None = None,
                    sweep_dir: str | None = None) -> Comparison:  # fmt: skip
    """The comparison (schema moe_perf.comparison/2) of arm records, per (model, tag), each
    decided under `plan` (the sweep's; None: one look at the end)."""
    groups: dict = {}
    for record in records:
        groups.setdefault((record.model, record.tag), []).append(record)
    sweep_ids = sorted({str(r.sweep_id) for r in records if r.sweep_id is not None})
    return Comparison(
        schema=SCHEMA,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        sweep_dir=sweep_dir,
        sweep_id=sweep_ids[0] if len(sweep_ids) == 1 else (sweep_ids or None),
        unstable_spread=UNSTABLE_SPREAD,
        notes=tuple(notes or ()),
        groups=tuple(compare_group(m, t, rs, plan) for (m, t), rs in sorted(groups.items())),
    )


# ---- entry points ----------------------------------------------------------------------------


def compare_sweep(sweep_dir: Path | str, write: bool = True) -> tuple[Comparison, str]:
    """(report, text) for a sweep directory; writes the comparison files there if `write`
    (the report then names them, as comparison.json does)."""
    sweep_dir = Path(sweep_dir).resolve()
    records, notes = load_sweep(sweep_dir)
    saved = load_plan(sweep_dir)
    plan = Plan(**saved["plan"]) if saved else None
    report = compare_records(records, notes, plan, sweep_dir=str(sweep_dir))
    if write:
        report = render_explain.write_plot(report, sweep_dir)  # explain.png, in each section
        report = imbalance.write_plot(report, sweep_dir)  # step time against imbalance, likewise
        report = write_outputs(report, sweep_dir)
    return report, render(report)


def read_comparison(path: Path | str) -> Comparison:
    """A comparison.json of this or an older schema; /1 reports have no verdict (None).
    ComparisonError (a ValueError) says why a file is none."""
    return Comparison.load(path)
