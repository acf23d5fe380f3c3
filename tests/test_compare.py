"""The comparison: summaries, grouping, refusals, repeats, outputs and the CLI.

Arm records are built the way a real arm's are: contract lines written to a console log,
parsed and summarized by moe_perf's own code, then saved as metrics.json in a sweep layout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.pictures import drawn, png_pixels

from moe_perf.common.contract import format_step
from moe_perf.report import cli
from moe_perf.report import comparison as compare
from moe_perf.report.record import summarize
from moe_perf.report.render import figure
from moe_perf.report.results import Step
from moe_perf.runner import outputs

TAG = "pp1-dp2-cp1-ep2-seq64-bf16"
CONFIG = {
    "model": {"name": "tiny", "num_experts": 8},
    "mesh": {"nnodes": 1, "nproc_per_node": 2, "pp": 1, "cp": 1, "ep": 2},
    "training": {"sequence_length": 64, "global_batch": 8, "max_steps": 8},
    "refs": {"base": "main", "feat": "feature"},
    "tag": TAG,
}


def write_log(path: Path, step_times: list[float], tokens_per_step: float = 512.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["some start-up chatter"]
    for step, t in enumerate(step_times, start=1):
        line = format_step(
            step,
            len(step_times),
            step_time_s=t,
            tokens_per_s=tokens_per_step / t,
            peak_mem_gib=1.25,
            loss=10.0 - step * 0.1,
        )
        lines.append("[rank0]:" + line)
    path.write_text("\n".join(lines) + "\n")
    return path


def write_arm(
    sweep: Path,
    arm: str,
    step_times: list[float],
    *,
    repeat: int | None = None,
    tag: str = TAG,
    model: str = "tiny",
    sha: str | None = None,
    config: dict | None = None,
    **fields,
) -> Path:
    """An arm directory as the runner lays it out, with console.log and metrics.json."""
    name = f"{tag}-{arm}" + (f"-r{repeat}" if repeat is not None else "")
    arm_dir = sweep / model / name
    log = write_log(arm_dir / "console.log", step_times)
    record = dataclasses.replace(
        compare.record_from_log(log, arm, "contract"),
        model=model,
        tag=tag,
        repeat=repeat or 0,
        ref="main" if arm == "base" else "feature",
        sha=sha or ("a" * 40 if arm == "base" else "b" * 40),
        exit_code=0,
        arm_dir=str(arm_dir),
        config={**(config or CONFIG), "arm": {"name": arm}, "repeat": repeat or 0},
    )
    record = dataclasses.replace(record, **fields)
    record.dump(arm_dir / "metrics.json")
    return arm_dir


def flat(values: list[float], first: float = 3.0) -> list[float]:
    return [first, *values]


def test_summarize_drops_first_step_medians_and_peak():
    steps = [
        {"step": 2, "step_time_s": 0.5, "tokens_per_s": 100.0, "peak_mem_gib": 2.0, "mfu": None},
        {"step": 1, "step_time_s": 9.0, "tokens_per_s": 1.0, "peak_mem_gib": 9.0, "mfu": None},
        {"step": 3, "step_time_s": 0.7, "tokens_per_s": 80.0, "peak_mem_gib": 3.0, "mfu": None},
        {"step": 4, "step_time_s": 0.6, "tokens_per_s": 90.0, "peak_mem_gib": 1.0, "mfu": None},
    ]
    summary = summarize(steps)
    assert summary["steps_measured"] == 3
    assert summary["step_time_s"] == 0.6
    assert summary["tokens_per_s"] == 90.0
    assert summary["peak_mem_gib"] == 3.0  # maximum of the measured steps, step 1 excluded
    assert summary["mfu"] is None and summary["tflops"] is None  # unknown stays unknown


def test_stability_warning():
    def steps(times):
        return [Step(i, step_time_s=t) for i, t in enumerate(times, start=1)]

    assert compare.stability_warning(steps([5.0, 1.0, 1.05, 1.02, 0.98])) is None
    warning = compare.stability_warning(steps([5.0, 1.0, 1.6, 1.0, 1.0]))
    assert "unstable" in warning and "60%" in warning
    assert "too few" in compare.stability_warning(steps([5.0, 1.0]))


def test_sweep_feat_slower_table_and_files(tmp_path):
    write_arm(tmp_path, "base", flat([0.40] * 7))
    write_arm(tmp_path, "feat", flat([0.44] * 7))
    report, text = compare.compare_sweep(tmp_path)

    (group,) = report.groups
    assert group.status == "compared" and not group.aa
    step = group.difference["step_time_s"]
    assert step.pct == pytest.approx(10.0) and step.words == "slower"
    assert group.difference["tokens_per_s"].words == "slower"
    assert "| feat vs base |  | +10.00% (slower) | -9.09% (slower) | +0.00% (same)" in text
    # one pair gives no run-to-run spread: no decision, and the reason says so
    verdict = group.verdict["step_time_s"]
    assert (verdict.word, verdict.pairs, group.pairs) == ("UNKNOWN", 1, 1)
    assert verdict.estimate == pytest.approx(0.10) and verdict.low is None
    assert "**Step time**: " in text and verdict.reason in text
    for word in ("PASS", "FAIL", "regression"):
        assert word not in text

    saved = json.loads((tmp_path / "comparison.json").read_text())
    assert saved["schema"] == "moe_perf.comparison/2"
    assert compare.read_comparison(tmp_path / "comparison.json").groups[0].verdict
    assert saved["groups"][0]["arms"]["base"]["step_time_s"]["median"] == pytest.approx(0.40)
    assert (tmp_path / "comparison.md").read_text() == text
    assert png_pixels(tmp_path / "comparison.png") == (1300, 380)  # one row: one (model, tag)
    steps, tokens, memory = (drawn(ax) for ax in figure(report).axes)
    assert steps.lines["base r0"] == ([2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], [0.40] * 7)
    assert steps.lines["feat r0"] == ([2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], [0.44] * 7)
    assert tokens.title == "tokens/s (median of runs)\nfeat -9.09%"
    assert tokens.xticklabels == memory.xticklabels == ["base", "feat"]


def test_latest_sweep_only_and_previous_ignored(tmp_path):
    old_base = write_arm(tmp_path, "base", flat([9.0] * 7), sweep_id="old")
    old_feat = write_arm(tmp_path, "feat", flat([9.0] * 7), tag="other", sweep_id="old")
    for arm_dir in (old_base, old_feat):
        os.utime(arm_dir / "metrics.json", (1_000_000, 1_000_000))
    write_arm(tmp_path / "tiny" / "previous" / "x", "feat", flat([7.0] * 7), sweep_id="new")
    write_arm(tmp_path, "feat", flat([0.5] * 7), sweep_id="new")
    # the new sweep's base arm overwrote the old one in place
    write_arm(tmp_path, "base", flat([0.5] * 7), sweep_id="new")

    records, _ = compare.load_sweep(tmp_path)
    assert sorted(r.arm for r in records) == ["base", "feat"]
    assert {r.sweep_id for r in records} == {"new"}
    assert all("previous" not in r.path.parts for r in records)


def test_config_difference_refuses_with_keys(tmp_path):
    write_arm(tmp_path, "base", flat([0.4] * 7))
    other = {**CONFIG, "training": {**CONFIG["training"], "global_batch": 16}}
    write_arm(tmp_path, "feat", flat([0.4] * 7), config=other)
    report, text = compare.compare_sweep(tmp_path, write=False)

    (group,) = report.groups
    assert group.status == "refused" and group.difference == {}
    assert [d["key"] for d in group.config_differences] == ["training.global_batch"]
    assert "Comparison refused" in text and "`training.global_batch`" in text
    assert "feat vs base" not in text
    assert not (tmp_path / "comparison.json").exists()  # write=False


def test_arm_and_repeat_keys_do_not_count_as_differences(tmp_path):
    write_arm(tmp_path, "base", flat([0.4] * 7), repeat=0)
    write_arm(tmp_path, "feat", flat([0.4] * 7), repeat=1)
    report, _ = compare.compare_sweep(tmp_path, write=False)
    assert report.groups[0].status == "compared"


def test_aa_run_is_said(tmp_path):
    write_arm(tmp_path, "base", flat([0.4] * 7), sha="c" * 40)
    write_arm(tmp_path, "feat", flat([0.4] * 7), sha="c" * 40)
    report, text = compare.compare_sweep(tmp_path, write=False)
    assert report.groups[0].aa
    assert "A/A run: base and feat are the same commit cccccccccccc" in text


def test_failed_arm_shows_reason_and_log(tmp_path):
    write_arm(tmp_path, "base", flat([0.4] * 7))
    feat = write_arm(
        tmp_path, "feat", [], status="failed", exit_code=1, failure="trainer exited 1: OOM"
    )
    report, text = compare.compare_sweep(tmp_path)

    (group,) = report.groups
    assert group.status == "incomplete"
    assert "| feat | failed |" in text
    assert f"- feat r0 FAILED: trainer exited 1: OOM; log: {feat / 'console.log'}" in text
    assert "No difference computed: no successful run of feat" in text
    steps, tokens, _ = (drawn(ax) for ax in figure(report).axes)  # base still plotted
    assert steps.lines["base r0"][1] == [0.4] * 7
    assert steps.lines["feat r0 FAILED (no steps)"] == ([], [])
    assert tokens.texts[-1] == "failed" and len(tokens.bars) == 1
    assert png_pixels(tmp_path / "comparison.png") == (1300, 380)


def test_repeats_median_of_medians_and_spread(tmp_path):
    # Pooling all steps would give a different median than the median of the run medians.
    # Here: medians 0.30, 0.31, 0.32 -> 0.31; all 21 steps pooled -> 0.32. The slow steps are
    # interleaved: a run whose last steps all jump to 0.50 has not settled (test_steady.py).
    base_runs = [[t, 0.50] * 3 + [t] for t in (0.30, 0.31, 0.32)]
    feat_runs = [[0.42] * 7, [0.43] * 7, [0.44] * 7]
    for k, (b, f) in enumerate(zip(base_runs, feat_runs, strict=True)):
        write_arm(tmp_path, "base", flat(b), repeat=k)
        write_arm(tmp_path, "feat", flat(f), repeat=k)
    report, text = compare.compare_sweep(tmp_path, write=False)

    (group,) = report.groups
    base = group.arms["base"]
    assert base.runs_ok == 3
    assert all(run.summary.settled for run in group.runs)
    assert base.figures["step_time_s"].median == pytest.approx(0.31)
    assert (base.figures["step_time_s"].min, base.figures["step_time_s"].max) == pytest.approx(
        (0.3, 0.32)
    )
    assert group.difference["step_time_s"].within_spread is False
    assert "| base | 3 | 0.3100 [0.3000-0.3200]" in text
    # the pairs' log-ratios (0.336, 0.327, 0.318) sit far from zero: one look, fixed repeats
    verdict = group.verdict["step_time_s"]
    assert (verdict.word, verdict.pairs) == ("DIFFERENT", 3)
    assert verdict.low > 0.2 and group.plan["sequential"] is False
    assert "Warning: base r2 looks unstable" in text


def test_repeats_overlap_said_within_spread(tmp_path):
    for k, (b, f) in enumerate([(0.40, 0.41), (0.42, 0.40), (0.44, 0.43)]):
        write_arm(tmp_path, "base", flat([b] * 7), repeat=k)
        write_arm(tmp_path, "feat", flat([f] * 7), repeat=k)
    report, text = compare.compare_sweep(tmp_path, write=False)
    # feat vs base: +2.5%, -4.9%, -2.3%: the interval spans zero and the 1% effect
    verdict = report.groups[0].verdict["step_time_s"]
    assert (verdict.word, verdict.pairs) == ("UNKNOWN", 3)
    assert verdict.low < -0.01 < 0.01 < verdict.high
    assert "UNKNOWN" in text


def test_two_meshes_give_two_groups(tmp_path):
    for tag in (TAG, "pp2-dp1-cp1-ep2-seq64-bf16"):
        config = {**CONFIG, "tag": tag}
        write_arm(tmp_path, "base", flat([0.4] * 7), tag=tag, config=config)
        write_arm(tmp_path, "feat", flat([0.4] * 7), tag=tag, config=config)
    report, text = compare.compare_sweep(tmp_path)
    assert [g.tag for g in report.groups] == [
        "pp1-dp2-cp1-ep2-seq64-bf16",
        "pp2-dp1-cp1-ep2-seq64-bf16",
    ]
    assert all(g.status == "compared" for g in report.groups)
    assert text.count("| feat vs base |") == 2


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moe_perf.compare", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow
def test_cli_two_logs_same_numbers_as_sweep(tmp_path):
    base = write_arm(tmp_path / "sweep", "base", flat([0.40, 0.41, 0.39, 0.40, 0.42, 0.40, 0.40]))
    feat = write_arm(tmp_path / "sweep", "feat", flat([0.44, 0.45, 0.43, 0.44, 0.44, 0.46, 0.44]))
    _, sweep_text = compare.compare_sweep(tmp_path / "sweep", write=False)
    diff_row = next(line for line in sweep_text.splitlines() if line.startswith("| feat vs base"))

    logs = run_cli(str(base / "console.log"), str(feat / "console.log"), "--out", str(tmp_path))
    assert logs.returncode == 0, logs.stderr
    assert diff_row in logs.stdout
    assert png_pixels(tmp_path / "comparison.png") == (1300, 380)  # the figure of one group

    records = run_cli(str(base / "metrics.json"), str(feat / "metrics.json"))
    assert records.returncode == 0, records.stderr
    assert diff_row in records.stdout and "tiny" in records.stdout

    sweep = run_cli(str(tmp_path / "sweep"), "--no-write")
    assert sweep.returncode == 0 and sweep.stdout == sweep_text


@pytest.mark.slow
def test_cli_missing_file_is_a_message(tmp_path):
    result = run_cli(str(tmp_path / "nope.log"), str(tmp_path / "nope2.log"))
    assert result.returncode == 2
    assert "moe_perf.compare:" in result.stderr and "Traceback" not in result.stderr


def test_environment_difference_is_noted(tmp_path):
    write_arm(tmp_path, "base", flat([0.4] * 7), environment={"host": "n1", "devices": ["H200"]})
    write_arm(tmp_path, "feat", flat([0.4] * 7), environment={"host": "n1", "devices": ["H100"]})
    report, text = compare.compare_sweep(tmp_path, write=False)
    (group,) = report.groups
    assert group.status == "compared"  # noted, not refused
    assert group.environment_differences == (
        'environment `devices` differs between arms (base: ["H200"]; feat: ["H100"])',
    )
    assert "Note: environment `devices` differs between arms" in text


def test_runner_state_names_the_current_sweep(tmp_path):
    write_arm(tmp_path, "base", flat([0.4] * 7), sweep_id="20260101-old")
    write_arm(tmp_path, "feat", flat([0.4] * 7), sweep_id="20260101-old")
    state = tmp_path / ".moe_perf" / "sweep.json"
    state.parent.mkdir()
    state.write_text(json.dumps({"sweep_id": "20260202-new"}))
    # The current sweep wrote no record (every arm failed early): show nothing, not old numbers.
    report, text = compare.compare_sweep(tmp_path, write=False)
    assert report.groups == ()
    assert "2 record(s) of earlier sweeps ignored; showing sweep 20260202-new" in text

    write_arm(tmp_path, "feat", flat([0.5] * 7), sweep_id="20260202-new")
    report, _ = compare.compare_sweep(tmp_path, write=False)
    (group,) = report.groups
    assert list(group.arms) == ["feat"] and group.status == "incomplete"


def test_cli_two_arm_directories_as_the_sweep_prints_them(tmp_path, capsys):
    base = write_arm(tmp_path / "sweep", "base", flat([0.40, 0.41, 0.39, 0.40, 0.42, 0.40, 0.40]))
    feat = write_arm(tmp_path / "sweep", "feat", flat([0.44, 0.45, 0.43, 0.44, 0.44, 0.46, 0.44]))
    _, sweep_text = compare.compare_sweep(tmp_path / "sweep", write=False)
    diff_row = next(line for line in sweep_text.splitlines() if line.startswith("| feat vs base"))
    assert cli.main([str(base), str(feat)]) == 0
    assert diff_row in capsys.readouterr().out
    (feat / "metrics.json").unlink()  # an arm that never wrote its record: its console.log
    assert cli.main([str(base), str(feat)]) == 0
    assert diff_row in capsys.readouterr().out


def test_cli_two_sweep_directories_of_one_arm_each(tmp_path, capsys):
    # two single runs (`python -m moe_perf arm=base`), say on two machines, with repeats in one
    write_arm(tmp_path / "one", "base", flat([0.40] * 7), sweep_id="s1")
    for repeat, t in enumerate((0.50, 0.52)):
        write_arm(tmp_path / "two", "base", flat([t] * 7), repeat=repeat, sweep_id="s2")
    assert cli.main([str(tmp_path / "one"), str(tmp_path / "two"), "--json"]) == 0
    (group,) = json.loads(capsys.readouterr().out)["groups"]
    assert group["status"] == "compared"
    assert group["arms"]["feat"]["runs_ok"] == 2
    assert group["difference"]["step_time_s"]["pct"] == pytest.approx(27.5)


def test_cli_a_sweep_of_both_arms_is_no_side(tmp_path, capsys):
    write_arm(tmp_path / "sweep", "base", flat([0.40] * 7))
    feat = write_arm(tmp_path / "sweep", "feat", flat([0.44] * 7))
    assert cli.main([str(tmp_path / "sweep"), str(feat)]) == 2
    err = capsys.readouterr().err
    assert "holds the arms base and feat of one sweep: give it alone" in err
    assert "Traceback" not in err


def test_an_earlier_sweep_moved_aside_names_its_files_where_they_are_now(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    write_arm(sweep, "base", flat([0.4] * 7), sweep_id="old")
    feat = write_arm(sweep, "feat", [], sweep_id="old", status="failed", exit_code=1,
                     failure="trainer exited 1: OOM")  # fmt: skip
    state = sweep / ".moe_perf" / "sweep.json"
    state.parent.mkdir()
    state.write_text(json.dumps({"sweep_id": "old"}))
    assert outputs.move_earlier_sweeps(sweep) == {"old": sweep / "previous" / "old"}
    assert cli.main([str(sweep), "--sweep", "old", "--no-write", "--json"]) == 0
    (group,) = json.loads(capsys.readouterr().out)["groups"]
    moved = sweep / "previous" / "old" / "tiny" / feat.name
    failed = next(run for run in group["runs"] if run["arm"] == "feat")
    assert failed["log"] == str(moved / "console.log")
    assert all(Path(run["log"]).is_file() for run in group["runs"])
