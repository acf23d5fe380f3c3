"""The steady-state rule (moe_perf/stats/steady.py): on step series written for each case, on
its simulation's error rates (bench/steady_simulation.py), on real logs read by the project's
own log reader, and through the summary, the arm record (schema /2, /1 read back) and the
comparison."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from moe_perf.logs import RunShape, parse_lines, parse_log
from moe_perf.report import comparison
from moe_perf.report.record import SCHEMA, load_record, summarize
from moe_perf.report.results import ArmRecord, Step, Summary
from moe_perf.report.results.checks import record_problems
from moe_perf.runner.arm import report as report_arm
from moe_perf.stats.steady import BAND_FLOOR, MIN_STEPS, settle

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
sys.path.insert(0, str(ROOT / "bench"))

import steady_simulation as sim  # noqa: E402  (bench/)


def after_step_1(times: list[float]):
    """settle() of the measured steps 2, 3, ... with these step times."""
    return settle(range(2, len(times) + 2), times)


def counts(summary: dict) -> tuple[int, int, bool]:
    return summary["steps_measured"], summary["steps_settling"], summary["settled"]


def steps_of(times: list[float], tokens: float = 65536.0) -> list[dict]:
    return [
        {"step": k, "step_time_s": t, "tokens_per_s": tokens / t, "peak_mem_gib": 70.0 + k / 10}
        for k, t in enumerate(times, start=1)
    ]


# ---- the rule on written series --------------------------------------------------------------


def test_a_flat_run_drops_nothing_after_step_1():
    found = after_step_1([0.501, 0.499, 0.503, 0.500, 0.498, 0.502, 0.500])
    assert (found.first_steady_step, found.dropped, found.settled, found.reason) == (2, 0, True, "")
    assert found.level_s == pytest.approx(0.500)
    assert found.band_s == pytest.approx(BAND_FLOOR * 0.500)  # GPU-flat: the floor is the band


def test_torchtitans_warm_second_step_is_dropped():
    # torchtitan 0.2.2 on an H100: step 2 1.24 s, then 0.84-0.85 s
    found = after_step_1([1.24, 0.849, 0.845, 0.851, 0.848, 0.852, 0.847])
    assert (found.first_steady_step, found.dropped, found.settled) == (3, 1, True)
    assert found.reason == (
        "step 2 still settling, outside 0.8495 s +- 5.0% (the band around the later half's "
        "median): dropped"
    )


def test_megatrons_step_2_line_averaging_steps_1_and_2_is_dropped():
    # printed 2226.1 ms: the mean of step 1 (3537.9 ms) and its own 914 ms; later steps as noisy
    # as Megatron-LM with local layers runs on an H200
    found = after_step_1([2.2261, 0.7984, 0.801, 0.729, 0.797, 0.984, 0.775, 0.812, 0.790])
    assert (found.dropped, found.settled) == (1, True)


def test_two_warm_steps_are_both_dropped_and_a_later_straggler_is_not():
    found = after_step_1([1.50, 1.20, 1.00, 1.01, 0.99, 1.00, 1.00, 1.35, 1.01, 1.00, 0.99])
    assert (found.first_steady_step, found.dropped, found.settled) == (4, 2, True)
    assert "steps 2-3 still settling" in found.reason


def test_a_faster_leading_step_is_settling_too():
    # a GPU that boosts its clock while cool, then settles slower: steps 2-3 outside the band
    found = after_step_1([0.90, 0.93, 1.00, 1.00, 1.01, 0.99, 1.00])
    assert (found.dropped, found.settled) == (2, True)


def test_a_run_trending_throughout_is_unsettled():
    found = after_step_1([1.30, 1.25, 1.20, 1.15, 1.10, 1.05, 1.00])
    assert not found.settled and found.dropped == 3  # the whole first half, no more
    assert found.reason.startswith("never settled in the first half of the run: steps 2-4 all")
    assert "run more steps" in found.reason


def test_a_slow_drift_through_the_kept_steps_is_unsettled():
    times = [1.0 + 0.002 * k for k in range(39)]  # +7.6% over 39 steps, each inside the band
    found = after_step_1(times)
    assert not found.settled and found.dropped < 19
    # +7% over steps 5-40, against the band of 5% of the later half's median (1.057 s)
    assert found.reason == (
        "never settled: step time drifts +6.6% from step 5 to step 40 (Kendall's tau p < 0.01), "
        "more than its band of +- 5.0%"
    )


def test_a_drift_smaller_than_the_band_is_settled():
    found = after_step_1([1.0 + 0.0008 * k for k in range(39)])  # +3% over the run
    assert (found.dropped, found.settled) == (0, True)


def test_never_fewer_than_half_of_the_measured_steps_are_kept():
    rng = np.random.default_rng(7)
    for m in range(MIN_STEPS, 41):
        for _ in range(50):
            times = np.exp(rng.standard_normal(m) * rng.choice([0.01, 0.3, 1.5]))
            found = after_step_1(list(times))
            assert m - found.dropped >= math.ceil(m / 2)
    slow_first_half = after_step_1([10.0] * 5 + [1.0] * 4)
    assert (slow_first_half.dropped, slow_first_half.settled) == (4, False)


def test_too_few_steps_are_not_judged():
    found = after_step_1([5.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # a 7-step run; MIN_STEPS is 7
    assert (found.first_steady_step, found.dropped, found.settled) == (2, 0, True)
    assert found.reason == "not judged: 6 measured step(s), 7 needed to tell settling"
    assert settle([], []).first_steady_step is None
    zero = after_step_1([1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert (zero.dropped, zero.settled) == (0, True) and "not a positive number" in zero.reason
    with pytest.raises(ValueError, match="3 steps but 2 step times"):
        settle([2, 3, 4], [1.0, 1.0])


# ---- the simulation's rates ------------------------------------------------------------------

RUNS = 1000


@pytest.mark.parametrize("case", sim.STEADY, ids=lambda c: c.name)
@pytest.mark.parametrize("steps", [8, 40])
def test_simulated_steady_runs_keep_their_steps(case, steps):
    r = sim.rates(case, steps, RUNS if steps == 8 else RUNS // 4, seed=steps)
    noisy = case.noise > 0.01 or case.stragglers
    # GPU-like flat runs: nothing dropped after step 1; noisy ones: about as often as a leading
    # straggler (5% here) or a 4-sigma step of a small sample
    assert r.dropped_any <= (0.07 if noisy else 0.002)
    assert r.unsettled <= (0.01 if noisy else 0.002)


@pytest.mark.parametrize("case", sim.WARM, ids=lambda c: c.name)
@pytest.mark.parametrize("steps", [8, 40])
def test_simulated_warm_steps_are_dropped(case, steps):
    r = sim.rates(case, steps, RUNS if steps == 8 else RUNS // 4, seed=steps)
    assert r.warm_dropped >= 0.97 and r.dropped_mean <= len(case.warm) + 0.1
    assert r.unsettled <= 0.01


@pytest.mark.parametrize(("steps", "at_least"), [(8, 0.8), (40, 0.99)])
def test_simulated_warm_step_among_stragglers_is_mostly_dropped(steps, at_least):
    # a straggler among few steps widens the band: the rule keeps the warm step then, an error
    # toward keeping steps; longer runs drop it
    (case,) = sim.WARM_WITH_STRAGGLERS
    r = sim.rates(case, steps, RUNS if steps == 8 else RUNS // 4, seed=steps)
    assert r.warm_dropped >= at_least and r.unsettled <= 0.01


@pytest.mark.parametrize("case", sim.UNSETTLED, ids=lambda c: c.name)
@pytest.mark.parametrize("steps", [8, 40])
def test_simulated_trending_runs_are_unsettled(case, steps):
    r = sim.rates(case, steps, RUNS if steps == 8 else RUNS // 4, seed=steps)
    assert r.unsettled >= 0.9
    assert r.fewest_kept >= math.ceil((steps - 1) / 2)


def test_the_simulation_table_has_every_case_and_length():
    text = sim.table(runs=20, seed=0)
    assert len(text.splitlines()) == 2 + len(sim.CASES) * len(sim.STEPS)
    assert "| flat, 0.3% noise (reference trainer, H100) | 8 | 0.0% | - | 0.00 | 0.0% |" in text


# ---- real logs, read by the project's log reader ---------------------------------------------


@pytest.mark.parametrize("name", ["compiled_cold", "compiled_warm", "eager"])
def test_reference_trainer_on_an_h100_is_flat_from_step_2(name):
    """30 steps of the reference trainer (4 layers of qwen3-30b-a3b, seq 2048, global batch 32,
    micro-batch 8) on an H100: its contract lines as printed."""
    parsed = parse_log(DATA / f"h100_reference_{name}.log")
    assert parsed.log_format == "contract" and len(parsed.steps) == 30
    summary = summarize(parsed.steps)
    assert counts(summary) == (29, 0, True)
    times = [s["step_time_s"] for s in parsed.steps[1:]]
    # the floor sets the band: the steps lie well within 5% of their median (under 2%)
    assert max(abs(t / summary["step_time_s"] - 1) for t in times) < 0.4 * BAND_FLOOR
    assert after_step_1(times).band_s == pytest.approx(BAND_FLOOR * after_step_1(times).level_s)


# torchtitan's own line, as REFERENCE documents it, with the figures of its H100 run: 65,536
# tokens a step on one GPU, step 2 1.24 s (1.37 s in another run), then 0.845-0.852 s
TITAN_LINE = (
    "[rank0]:[titan] 2026-07-17 12:05:19,496 - root - INFO - step:  2  loss:  6.09081  "
    "grad_norm:  4.2098  memory:  4.26GiB(2.39%)  tps: 72,915  tflops: 39.59  mfu: N/A"
)
TITAN_SHAPE = RunShape(global_batch=32, seq_length=2048, world_size=1)


def titan_log(times: list[float]) -> list[str]:
    lines, clock = [], 19.496
    for step, t in enumerate(times, start=1):
        clock += t
        stamp = f"12:{5 + int(clock // 60):02d}:{clock % 60:06.3f}".replace(".", ",")
        line = re.sub(r"12:05:19,496", stamp, TITAN_LINE)
        line = re.sub(r"step:  2", f"step: {step:2d}", line)
        lines.append(re.sub(r"tps: 72,915", f"tps: {round(65536 / t):,}", line))
    return lines


@pytest.mark.parametrize("second", [1.24, 1.37])
def test_torchtitan_log_second_step_dropped_and_no_longer_unstable(second):
    times = [24.0, second, 0.845, 0.851, 0.849, 0.848, 0.852, 0.847]
    parsed = parse_lines(titan_log(times), "auto", TITAN_SHAPE)
    assert parsed.log_format == "torchtitan" and not parsed.problems
    summary = summarize(parsed.steps)
    assert counts(summary) == (6, 1, True)
    assert summary["step_time_s"] == pytest.approx(0.8485, rel=1e-3)
    assert summary["settling"].startswith("step 2 still settling")
    # counted, its 1.24 s made the run "unstable" (a 46% span); dropped, the run is stable
    assert comparison.stability_warning([Step.from_dict(s) for s in parsed.steps]) is None


# Megatron-LM d98e8a6 on an H200 (qwen3-30b-a3b, 2 layers): iterations 1-3 as printed.
MEGATRON_H200 = [
    f"[default0]: [2026-12-04 19:05:{stamp}] iteration        {step}/      10 | consumed "
    f"samples:            {8 * step} | elapsed time per iteration (ms): {ms} | throughput per "
    f"GPU (TFLOP/s/GPU): {tflops} | learning rate: 2.700000E-04 | global batch size:     8 | "
    f"lm loss: 1.234171E+01 | loss scale: 1.0 | grad norm: 2.171 | number of skipped "
    f"iterations:   0 | number of nan iterations:   0 |"
    for stamp, step, ms, tflops in [("28.634069", 1, 3537.9, 12.3),
                                    ("29.548264", 2, 2226.1, 19.5),
                                    ("30.346706", 3, 798.4, 54.3)]
]  # fmt: skip
# Iterations 4-10 at the spread of that machine's 10-step A/A base run (median 0.797 s,
# 0.729-0.984 s), its last line's fields changed.
LATER_MS = [801.0, 729.0, 796.8, 984.0, 775.0, 812.0, 790.0]


def megatron_log(keep_timestamps: bool) -> list[str]:
    lines, clock = list(MEGATRON_H200), 30.346706
    for step, ms in enumerate(LATER_MS, start=4):
        clock += ms / 1000
        line = MEGATRON_H200[-1].replace("30.346706", f"{clock:09.6f}")
        line = line.replace("iteration        3/", f"iteration        {step}/")
        line = line.replace("samples:            24", f"samples:            {8 * step}")
        lines.append(line.replace("(ms): 798.4", f"(ms): {ms}"))
    if not keep_timestamps:
        lines = [re.sub(r" \[2026-12-04 [\d:.]+\]", "", line) for line in lines]
    return lines


def test_megatron_averaged_step_2_dropped_where_the_reader_cannot_undo_it():
    # without the lines' timestamps the reader keeps the printed mean over steps 1-2, 2226 ms:
    # the steady-state rule drops it
    parsed = parse_lines(megatron_log(keep_timestamps=False), "megatron", RunShape(8, 2048, 1))
    assert parsed.steps[1]["step_time_s"] == pytest.approx(2.2261)
    summary = summarize(parsed.steps)
    assert counts(summary) == (8, 1, True)
    assert summary["step_time_s"] == pytest.approx(0.7976)
    # with them, step 2 gets its own 914 ms back, within this noisy run's band: kept
    parsed = parse_lines(megatron_log(keep_timestamps=True), "megatron", RunShape(8, 2048, 1))
    assert parsed.steps[1]["step_time_s"] == pytest.approx(0.9142, rel=1e-3)
    summary = summarize(parsed.steps)
    assert counts(summary) == (9, 0, True)


# ---- the summary, the record, the comparison -------------------------------------------------


def test_summary_counts_settling_steps_and_their_figures_leave_the_medians():
    steps = steps_of([24.0, 1.24, 0.845, 0.851, 0.849, 0.848, 0.852, 0.847])
    steps[1]["peak_mem_gib"] = 79.0  # a settling step's memory is no steady-state figure
    summary = summarize(steps)
    assert summary["steps_measured"] == 6 and summary["steps_settling"] == 1
    assert summary["step_time_s"] == pytest.approx(0.8485)
    steady = [0.845, 0.851, 0.849, 0.848, 0.852, 0.847]
    assert summary["tokens_per_s"] == pytest.approx(np.median([65536 / t for t in steady]))
    assert summary["peak_mem_gib"] == pytest.approx(70.8)


def test_unknown_step_times_before_the_first_steady_step_are_dropped_with_it():
    steps = steps_of([9.0, 1.5, 1.4, 1.0, 1.01, 0.99, 1.0, 1.02, 1.0])
    steps[2]["step_time_s"] = None  # step 3: no time printed, before the first steady step
    summary = summarize(steps)
    assert summary["steps_settling"] == 2 and summary["steps_measured"] == 6  # steps 4-9


def old_record(steps: list[dict]) -> dict:
    """A record as moe_perf wrote it under schema /1: step 1 alone dropped from its summary."""
    return {
        "schema": "moe_perf.arm/1", "sweep_id": "s1", "model": "tiny", "tag": "t", "arm": "base",
        "repeat": 0, "ref": "main", "sha": "a" * 40, "status": "ok", "exit_code": 0,
        "failure": None, "steps": steps,
        "summary": {"steps_measured": len(steps) - 1, "step_time_s": 0.849,
                    "tokens_per_s": 77172.0, "peak_mem_gib": 76.37, "tflops": None, "mfu": None},
        "environment": {}, "config": {},
    }  # fmt: skip


def test_schema_1_record_is_read_with_its_summary_recomputed(tmp_path):
    path = tmp_path / "metrics.json"
    steps = steps_of([24.0, 1.24, 0.845, 0.851, 0.849, 0.848, 0.852, 0.847])
    path.write_text(json.dumps(old_record(steps)))
    record, note = load_record(path)
    assert note is None and record.schema == "moe_perf.arm/1"
    assert record.summary.steps_settling == 1 and record.summary.settled is True
    assert record.summary.step_time_s == pytest.approx(0.8485)
    assert record.extra["summary_recomputed"] == "from the steps of a moe_perf.arm/1 record"
    # a /1 record without steps (an arm that failed) keeps the summary it was written with
    path.write_text(json.dumps({**old_record([]), "status": "failed", "failure": "OOM"}))
    record, note = load_record(path)
    assert note is None and record.summary.steps_measured == -1
    assert "summary_recomputed" not in record.extra


def test_schema_2_is_written_and_a_later_one_is_skipped_with_the_reason(tmp_path):
    assert SCHEMA == "moe_perf.arm/2"
    record = {**old_record(steps_of([3.0] + [1.0] * 7)), "schema": SCHEMA}
    record["summary"] = summarize(record["steps"])
    assert record_problems(record) == []
    assert record_problems({**record, "summary": {**record["summary"], "settled": 1}}) == [
        "summary.settled is 1, not bool"
    ]
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps({**record, "schema": "moe_perf.arm/3"}))
    assert load_record(path) == (
        None,
        f"skipped {path}: not a moe_perf.arm/2 record: schema 'moe_perf.arm/3' is not one this "
        f"moe_perf reads (moe_perf.arm/1, moe_perf.arm/2)",
    )


def test_comparison_flags_a_run_that_never_settled_in_plain_words():
    trending = steps_of([24.0, 1.30, 1.25, 1.20, 1.15, 1.10, 1.05, 1.00])
    flat = steps_of([24.0] + [1.00] * 7)
    records = [
        ArmRecord.from_dict({**old_record(flat), "schema": SCHEMA}, Path("base.json")),
        ArmRecord.from_dict({**old_record(trending), "schema": SCHEMA, "arm": "feat",
                             "sha": "b" * 40}, Path("feat.json")),
    ]  # fmt: skip
    report = comparison.compare_records(records)
    base, feat = report.groups[0].runs
    assert base.unsettled is None and base.summary.settled is True
    assert feat.unsettled.startswith("never settled in the first half of the run: steps 2-4")
    assert feat.summary.steps_settling == 3
    text = comparison.render(report)
    assert f"- Warning: feat r0 {feat.unsettled}" in text
    # the instability warning stays, and says what was dropped
    assert "feat r0 looks unstable" not in text  # 1.00-1.15 s: 15%, within 20%
    unstable = comparison.stability_warning([Step.from_dict(s) for s in steps_of(
        [24.0, 1.5, 1.0, 1.0, 1.3, 1.0, 1.0, 1.0, 1.0, 1.0])])  # fmt: skip
    assert unstable == ("looks unstable: step times span 30% of the median (1-1.3 s, first step "
                        "and 1 settling dropped); its numbers are less reliable")  # fmt: skip


def test_the_arms_console_line_counts_settling_steps_and_warns_of_an_unsettled_run(capsys):
    def arm(arm: str, steps: list[dict]) -> ArmRecord:
        summary = Summary.from_dict(summarize(steps))
        return ArmRecord(arm=arm, summary=summary, config={"trainer": {}})

    report_arm(arm("base", steps_of([24.0, 1.24] + [0.85] * 6)), "base")
    trending = steps_of([24.0, 1.30, 1.25, 1.20, 1.15, 1.10, 1.05, 1.00])
    report_arm(arm("feat", trending), "feat")
    out, err = capsys.readouterr()
    assert "base: ok, median step 0.8500 s" in out
    assert "(6 steps measured, step 1 and 1 settling step dropped)" in out
    assert "(4 steps measured, step 1 and 3 settling steps dropped)" in out
    assert err == f"[moe_perf] feat: warning: {summarize(trending)['settling']}\n"
