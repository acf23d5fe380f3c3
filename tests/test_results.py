"""The typed results read and write the files moe_perf writes, unchanged, and refuse others.

tests/data/results/ holds two real sweeps, written by moe_perf at commit bb7b721 (before the
typed results): `ab_repeats` is `python -m moe_perf <SMALL_RUN> -m arm=base,feat repeat=0,1`
in a make_ab_repo repository (feature 50 ms a step slower), `failed_feat` the same with one
pair and a feature branch whose trainer exits with code 3 after step 3. Each keeps its
comparison.json and comparison.md, the arms' metrics.json and the sweep's state
(.moe_perf/sweep.json, plan.json).
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest

from moe_perf.common.contract import METRICS
from moe_perf.report import comparison
from moe_perf.report.record import arm_record, load_record
from moe_perf.report.results import ArmRecord, RecordError, Step, Summary
from moe_perf.report.results.comparison import Comparison, ComparisonError
from moe_perf.runner import bisect, pairs
from moe_perf.stats.words import Verdict

DATA = Path(__file__).resolve().parent / "data" / "results"
RECORDS = sorted(DATA.rglob("metrics.json"))
COMPARISONS = sorted(DATA.glob("*/comparison.json"))


def test_the_fixtures_are_there():
    assert len(RECORDS) == 6 and len(COMPARISONS) == 2


@pytest.mark.parametrize("path", RECORDS, ids=lambda p: f"{p.parts[-4]}/{p.parts[-2]}")
def test_a_real_record_round_trips_to_the_same_file(path, tmp_path):
    data = json.loads(path.read_text())
    record = ArmRecord.from_dict(data)
    assert record.to_dict() == data
    assert list(record.to_dict()) == list(data)  # keys in the order written
    record.dump(tmp_path / "metrics.json")
    assert (tmp_path / "metrics.json").read_text() == path.read_text()  # byte for byte


@pytest.mark.parametrize("path", RECORDS, ids=lambda p: f"{p.parts[-4]}/{p.parts[-2]}")
def test_a_real_record_reads_as_typed_values(path):
    data = json.loads(path.read_text())
    record = ArmRecord.load(path)
    assert (record.arm, record.repeat, record.sha) == (data["arm"], data["repeat"], data["sha"])
    assert record.ok == (data["status"] == "ok") and record.failure == data["failure"]
    assert [s.step for s in record.steps] == [s["step"] for s in data["steps"]]
    assert [s.step_time_s for s in record.steps] == [s["step_time_s"] for s in data["steps"]]
    assert record.summary == Summary.of(record.steps)  # the file's summary is today's rule
    assert record.summary.step_time_s == data["summary"]["step_time_s"]
    assert record.section("arm", "name") == data["arm"]
    assert record.imports[0]["module"] == "mytrainer" and record.log_format == "contract"
    assert record.environment["world_size"] == 1 and record.path == path
    # read where it lies now, not where it was written
    assert record.arm_dir == str(path.parent) and record.log == str(path.parent / "console.log")


def test_the_failed_arm_says_why():
    (record,) = [ArmRecord.load(p) for p in RECORDS if p.parent.name.endswith("fp32-feat")]
    assert not record.ok and record.exit_code == 3
    assert record.failure == "trainer exited with code 3 (rank 0)"
    assert [s.step for s in record.steps] == [1, 2, 3]


@pytest.mark.parametrize("path", COMPARISONS, ids=lambda p: p.parent.name)
def test_a_real_comparison_round_trips_to_the_same_file(path, tmp_path):
    data = json.loads(path.read_text())
    report = Comparison.from_dict(data)
    assert report.to_dict() == data
    assert list(report.to_dict()) == list(data)
    report.dump(tmp_path / "comparison.json")
    assert (tmp_path / "comparison.json").read_text() == path.read_text()


def test_a_real_comparison_reads_as_typed_values():
    report = comparison.read_comparison(DATA / "ab_repeats" / "comparison.json")
    (group,) = report.groups
    assert group.status == "compared" and not group.aa and group.pairs == 2
    step_time = group.verdict["step_time_s"]
    assert isinstance(step_time, Verdict) and step_time.word == "DIFFERENT"
    assert step_time.low > 0 and group.difference["step_time_s"].words == "slower"
    base = [r for r in group.runs if r.arm == "base"]
    medians = [r.summary.step_time_s for r in base]
    assert group.arms["base"].figures["step_time_s"].median == statistics.median(medians)
    assert group.arms["base"].runs_ok == 2 and not report.failed_runs
    failed = comparison.read_comparison(DATA / "failed_feat" / "comparison.json")
    assert [r.failure for r in failed.failed_runs] == ["trainer exited with code 3 (rank 0)"]
    assert failed.groups[0].status == "incomplete" and failed.groups[0].verdict is None


def _normalized(report: dict) -> dict:
    """What depends on when and where a comparison was made taken out: its date, its
    directory, and the records' paths (read from a copy, they name where they lie now)."""
    out = {k: v for k, v in report.items() if k not in ("created", "sweep_dir", "files")}
    out["groups"] = [
        {**g, "runs": [{k: v for k, v in r.items() if k not in ("log", "metrics_json")}
                       for r in g["runs"]]}
        for g in report["groups"]
    ]  # fmt: skip
    return out


@pytest.mark.parametrize("name", ["ab_repeats", "failed_feat"])
def test_the_real_records_compare_as_they_did_when_written(name, tmp_path):
    sweep = shutil.copytree(DATA / name, tmp_path / name)
    report, text = comparison.compare_sweep(sweep)
    written = json.loads((DATA / name / "comparison.json").read_text())
    assert _normalized(report.to_dict()) == _normalized(written)
    again = json.loads((sweep / "comparison.json").read_text())  # rewritten where it lies now
    assert _normalized(again) == _normalized(written) and again["files"] == written["files"]
    assert (sweep / "comparison.md").read_text() == text
    # the table and the words as they were printed, the sweep's directory where it was then
    printed = (DATA / name / "comparison.md").read_text()
    assert text.replace(str(sweep), written["sweep_dir"]) == printed
    assert comparison.render(Comparison.from_dict(written)) == printed


def schema_1(record: dict) -> dict:
    """A record as moe_perf wrote it under schema /1: its summary dropped step 1 alone."""
    measured = sorted(record["steps"], key=lambda s: s["step"])[1:]

    def median(key):
        known = [s[key] for s in measured if s.get(key) is not None]
        return statistics.median(known) if known else None

    summary = {"steps_measured": len(measured)}
    summary.update({k: median(k) for k in METRICS if k not in ("peak_mem_gib", "loss")})
    summary["peak_mem_gib"] = max(s["peak_mem_gib"] for s in measured)
    return {**record, "schema": "moe_perf.arm/1", "summary": summary}


def test_a_schema_1_record_is_read_with_its_summary_recomputed(tmp_path):
    old = schema_1(json.loads(RECORDS[0].read_text()))
    assert "settled" not in old["summary"]
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps(old))
    record = ArmRecord.load(path)
    assert record.schema == "moe_perf.arm/1"
    assert record.summary == Summary.of(record.steps) and record.summary.settled is not None
    assert record.extra["summary_recomputed"] == "from the steps of a moe_perf.arm/1 record"
    assert record.to_dict()["schema"] == "moe_perf.arm/1"  # never passed off as /2


def test_a_schema_1_record_without_steps_keeps_its_summary_as_written():
    old = {**schema_1(json.loads(RECORDS[0].read_text())), "steps": [], "status": "failed"}
    record = ArmRecord.from_dict(old)
    assert record.summary.settled is None and "summary_recomputed" not in record.extra
    assert record.to_dict() == old  # no settling keys added to a /1 summary


def schema_1_comparison(report: dict) -> dict:
    """A comparison as moe_perf wrote it under schema /1: no verdict, plan or pairs, runs
    without `unsettled` and with /1 summaries, no import warnings."""
    later = ("verdict", "plan", "pairs", "unsettled_runs", "import_warnings")
    groups = [
        {**{k: v for k, v in g.items() if k not in later},
         "runs": [{**{k: v for k, v in r.items() if k != "unsettled"},
                   "summary": {k: v for k, v in r["summary"].items()
                               if k not in ("steps_settling", "settled", "settling")}}
                  for r in g["runs"]]}
        for g in report["groups"]
    ]  # fmt: skip
    return {**report, "schema": "moe_perf.comparison/1", "groups": groups}


def test_a_schema_1_comparison_is_read_without_verdicts(tmp_path):
    path = tmp_path / "comparison.json"
    old = schema_1_comparison(json.loads((DATA / "ab_repeats" / "comparison.json").read_text()))
    path.write_text(json.dumps(old))
    report = comparison.read_comparison(path)
    (group,) = report.groups
    assert report.schema == "moe_perf.comparison/1" and group.verdict is None
    assert group.plan is None and group.import_warnings == ()
    assert group.difference["step_time_s"].words == "slower"
    assert all(r.unsettled is None and r.summary.settled is None for r in group.runs)
    assert "verdict" not in report.to_dict()["groups"][0]


def test_a_record_of_wrong_types_is_refused_with_its_reasons(tmp_path):
    data = json.loads(RECORDS[0].read_text())
    data["status"] = "done"
    data["steps"][0]["step_time_s"] = "fast"
    data["summary"]["settled"] = 1
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps(data))
    why = (f"{path}: not a moe_perf.arm/2 record: status is 'done', not 'ok' or 'failed'; "
           f'steps[0].step_time_s is "fast", not int or float or null; '
           f"summary.settled is 1, not bool")  # fmt: skip
    with pytest.raises(RecordError) as refused:
        ArmRecord.load(path)
    assert str(refused.value) == why
    assert load_record(path) == (None, f"skipped {why}")
    assert pairs.read_record(tmp_path) is None  # the sweep counts it as no record
    path.write_text("[1, 2]")
    assert load_record(path)[1] == (f"skipped {path}: not a moe_perf.arm/2 record: the file "
                                    f"holds a JSON list, not an object")  # fmt: skip
    path.write_text("{")
    assert load_record(path)[1].startswith(f"skipped {path}: unreadable (")


def test_a_later_schema_is_refused_with_the_versions_read(tmp_path):
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps({**json.loads(RECORDS[0].read_text()), "schema": "moe_perf.arm/3"}))
    assert load_record(path) == (
        None,
        f"skipped {path}: not a moe_perf.arm/2 record: schema 'moe_perf.arm/3' is not one this "
        f"moe_perf reads (moe_perf.arm/1, moe_perf.arm/2)",
    )
    later = {**json.loads(COMPARISONS[0].read_text()), "schema": "moe_perf.comparison/3"}
    path = tmp_path / "comparison.json"
    path.write_text(json.dumps(later))
    with pytest.raises(ComparisonError) as refused:
        comparison.read_comparison(path)
    assert str(refused.value) == (f"{path}: schema 'moe_perf.comparison/3' is not one of "
                                  f"moe_perf.comparison/1, moe_perf.comparison/2")  # fmt: skip


def test_the_sweep_reads_each_pair_back_as_typed_records():
    arm_dir = DATA / "ab_repeats" / "tiny" / "pp1-dp1-cp1-ep1-seq64-fp32-feat-r1"
    record = pairs.read_record(arm_dir)
    assert isinstance(record, ArmRecord) and (record.arm, record.repeat) == ("feat", 1)
    assert pairs.read_record(arm_dir.parent / "no-such-arm") is None


def test_a_step_keeps_what_the_trainer_printed_beyond_the_contract():
    printed = {"step": 2, "step_time_s": 0.5, "tokens_per_s": 10.0, "peak_mem_gib": 1.0,
               "loss": None, "tflops": None, "mfu": None, "aux_loss": 0.002}  # fmt: skip
    step = Step.from_dict(printed)
    assert step.value("aux_loss") == 0.002 and step.value("expert_imbalance") is None
    assert step.to_dict() == printed and list(step.to_dict()) == list(printed)


@pytest.mark.parametrize(
    ("name", "word", "failed"),
    [("ab_repeats", "DIFFERENT", None),
     ("failed_feat", None, "feat failed: trainer exited with code 3 (rank 0)"),
     ("nothing", None, "the sweep wrote no comparison (exit code 3)")],
)  # fmt: skip
def test_a_bisect_probe_reads_its_sweeps_comparison(name, word, failed):
    probe = bisect.Probe(sha="0" * 40, subject="a commit", sweep_dir=str(DATA / name))
    bisect.read_verdict(probe, DATA / name, exit_code=3)
    assert (probe.word, probe.failed) == (word, failed)
    if word:
        written = json.loads((DATA / name / "comparison.json").read_text())
        verdict = written["groups"][0]["verdict"]["step_time_s"]
        assert (probe.estimate, probe.low, probe.high) == (verdict["estimate"], verdict["low"],
                                                           verdict["high"])  # fmt: skip
        assert probe.pairs == 2


def test_the_example_of_docs_outputs_md_runs_on_a_real_sweep(tmp_path, monkeypatch, capsys):
    page = (Path(__file__).resolve().parents[1] / "docs" / "outputs.md").read_text()
    example = page.split("## Reading results from Python", 1)[1].split("```python", 1)[1]
    sweep = shutil.copytree(DATA / "ab_repeats", tmp_path / "outputs" / "validate-performance")
    comparison.compare_sweep(sweep)  # comparison.json naming the records where they are now
    monkeypatch.chdir(tmp_path)
    exec(example.split("```", 1)[0], {})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "tiny pp1-dp1-cp1-ep1-seq64-fp32 compared DIFFERENT"
    assert [line.split(":")[0] for line in lines[1:5]] == [
        "  base r0 ok", "  base r1 ok", "  feat r0 ok", "  feat r1 ok"]  # fmt: skip
    sha = json.loads(RECORDS[0].read_text())["sha"]
    assert lines[5].startswith(f"{sha} ") and lines[5].endswith(" True 2.13.0+cpu")


def test_the_runner_writes_a_record_in_the_layout_it_always_had(tmp_path):
    """record.arm_record (what the runner calls when an arm ends) from the inputs of a real arm:
    the file has the real record's keys in the same order and the same figures."""
    real = json.loads(RECORDS[0].read_text())
    head = ("schema", "sweep_id", "model", "tag", "arm", "repeat", "ref", "sha", "status",
            "exit_code", "failure", "arm_dir", "log", "started", "finished", "wall_time_s",
            "trainer_wall_s", "steps", "summary", "environment", "config")  # fmt: skip
    record = arm_record(
        config=real["config"], sweep_id=real["sweep_id"], arm_dir=tmp_path, sha=real["sha"],
        exit_code=0, failure=None, steps=[{**s, "max_steps": 6} for s in real["steps"]],
        trainer_env=real["environment"]["trainer_env"], started=real["started"],
        wall_time_s=real["wall_time_s"], trainer_wall_s=real["trainer_wall_s"],
        extra={k: v for k, v in real.items() if k not in head},
    )  # fmt: skip
    record.dump(tmp_path / "metrics.json")
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert list(written) == list(real)
    assert written["steps"] == real["steps"]  # `max_steps` of the contract line not stored
    assert written["summary"] == real["summary"]
    assert written["arm_dir"] == str(tmp_path) and written["log"] == str(tmp_path / "console.log")
    assert written["environment"]["trainer_env"] == real["environment"]["trainer_env"]
