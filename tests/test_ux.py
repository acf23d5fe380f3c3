"""What a new user sees: --help, `list`, a run without -m, progress lines, the files listed and
the verdict at the end of a sweep, the picture, a quiet console, the exit codes.

The console tests run the real `python -m moe_perf` in temporary git repositories (the small
trainer of tests/helpers/small_trainer.py); the picture tests draw real PNGs from arm records.
"""

from __future__ import annotations

import io
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.command import SMALL_RUN, moe_perf, sweep_dir
from helpers.pictures import DrawnAxes, drawn, png_pixels

from moe_perf.common.contract import format_step
from moe_perf.launchers.process import run_trainer
from moe_perf.logs import LogReader
from moe_perf.logs.progress import StepProgress, UnmatchedLines, clock_time
from moe_perf.report.comparison import compare_records
from moe_perf.report.record import SCHEMA, summarize
from moe_perf.report.render import figure, verdict, write_outputs
from moe_perf.report.results import ArmRecord, Comparison
from moe_perf.runner.progress import RankThreads

ROOT = Path(__file__).resolve().parents[1]
EXIT_CODES = {0, 1, 2, 3, 130}
SHORT = [*(o for o in SMALL_RUN if not o.startswith("training.max_steps")), "training.max_steps=4"]


def run(cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=240, check=False)  # fmt: skip


# ---- help, list, exit codes ------------------------------------------------------------------


def documented_exit_codes(text: str) -> set[int]:
    section = text.split("xit codes", 1)[1]
    return {int(code) for code in re.findall(r"^\s*\|?\s*`?(\d+)`?\s", section, re.M)[:5]}


@pytest.mark.slow
def test_help_says_what_moe_perf_does_with_examples_groups_outputs_and_exit_codes(tmp_path):
    result = run(tmp_path, "moe_perf", "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "powered by Hydra" not in text
    assert "A/B step time of MoE training between two git branches" in text
    assert "python -m moe_perf [group=option ...] [key=value ...] -m arm=base,feat" in text
    assert "model=qwen3-30b-a3b mesh=ep8 -m arm=base,feat" in text  # A/B
    assert "-m mesh=ep2,pp2_ep2,cp2_ep2 arm=base,feat" in text  # a mesh sweep
    assert "-m repeat=0,1,2 arm=base,feat" in text  # repeats
    assert "python -m moe_perf list" in text
    # Hydra's own list of every group and its options, read from conf/
    for group in ("model", "mesh", "dtype", "arm", "trainer", "launcher"):
        options = sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml"))
        assert f"{group}: {', '.join(options)}" in text
    assert "outputs/validate-performance/" in text and "comparison.png" in text
    assert "multirun.yaml" in text and "wandb/" in text and ".moe_perf/sweep.json" in text
    assert documented_exit_codes(text) == EXIT_CODES
    assert "3    the sweep ran and at least one arm failed" in text
    assert "moe_perf_schema" not in text  # the typed schema's groups are internal
    assert "<sweep dir>/previous/<sweep id>/" in text and "<model>/previous" not in text
    assert "explain=true" in text and "explain.png" in text


@pytest.mark.slow
def test_compare_help_has_examples_outputs_and_exit_codes(tmp_path):
    result = run(tmp_path, "moe_perf.compare", "--help")
    assert result.returncode == 0, result.stderr
    assert "python -m moe_perf.compare outputs/validate-performance" in result.stdout
    assert "comparison.md, comparison.json and comparison.png" in result.stdout
    assert "exit codes: 0 compared" in result.stdout and "2 the" in result.stdout


def test_the_docs_document_the_same_exit_codes_and_outputs():
    page = (ROOT / "docs" / "outputs.md").read_text()
    assert documented_exit_codes(page) == EXIT_CODES
    outputs = page.split("## Outputs", 1)[1].split("\n## ", 1)[0]
    for name in ("comparison.png", "explain.png", "multirun.yaml", "wandb/", ".moe_perf/sweep.json",
                 ".moe_perf/identity/", "metrics.json", "console.log"):  # fmt: skip
        assert name in outputs, name


def test_the_docs_name_every_option_explain_and_the_tests_a_cpu_machine_skips():
    readme = (ROOT / "README.md").read_text()
    configuration = (ROOT / "docs" / "configuration.md").read_text()
    for group in ("model", "mesh", "dtype", "arm", "trainer", "launcher", "routing"):
        (row,) = [line for line in configuration.splitlines() if line.startswith(f"| `{group}` |")]
        for option in (p.stem for p in (ROOT / "conf" / group).glob("*.yaml")):
            assert f"`{option}`" in row, (group, option)
    assert "`explain=true`" in readme
    tests = readme.split("## Setup", 1)[1].split("\n## ", 1)[0]
    for skipped in ("Megatron-LM", "CUDA", "MOE_PERF_TORCHTITAN_03"):
        assert skipped in tests, skipped


# a path of this repository named in a doc: moe_perf/common/contract.py, not .moe_perf/...
_NAMED_PATH = re.compile(
    r"(?<![\w./])((?:moe_perf|bench|tests|conf|docs)/[\w./-]+\.(?:py|md|yaml))"
)


def test_every_source_path_the_docs_name_exists():
    docs = [ROOT / "README.md", ROOT / "conf" / "hydra" / "help" / "moe_perf.yaml",
            *(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md")]  # fmt: skip
    named = [(doc.name, path) for doc in docs for path in _NAMED_PATH.findall(doc.read_text())]
    assert [f"{doc}: {path}" for doc, path in named if not (ROOT / path).exists()] == []


@pytest.mark.slow
def test_list_shows_every_preset_in_one_line(tmp_path):
    result = run(tmp_path, "moe_perf", "list")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for kind in ("model", "mesh"):
        for path in sorted((ROOT / "conf" / kind).glob("*.yaml")):
            assert sum(line.split()[:1] == [path.stem] for line in lines) == 1, path.stem
    text = re.sub(r" +", " ", result.stdout)
    assert "qwen3-30b-a3b 48 layers 128 experts top-8" in text
    assert "tiny 2 layers 8 experts top-2" in text
    assert "pp2_ep8 world 16 pp2 cp1 ep8 dp8 GPU, 2 nodes x 8" in text
    assert "cp2_ep2 world 4 pp1 cp2 ep2 dp2 CPU or GPU" in text
    assert "ep8 world 8 pp1 cp1 ep8 dp8 GPU" in text


@pytest.mark.slow
def test_a_config_error_exits_1_and_a_prerequisite_error_exits_2(ab_repo):
    unknown = moe_perf(ab_repo, "model=no-such-model")
    assert unknown.returncode == 1, unknown.stderr
    assert "Could not find 'model/no-such-model'" in unknown.stderr
    impossible = moe_perf(ab_repo, *SMALL_RUN, "mesh.pp=3")
    assert impossible.returncode == 2, impossible.stderr
    assert (
        "world % pp == 0 fails" in impossible.stderr and "nothing was launched" in impossible.stderr
    )


# ---- the console of real runs ----------------------------------------------------------------


@pytest.mark.slow
def test_one_arm_says_nothing_was_compared_and_how_to_compare(ab_repo):
    # wandb in auto mode with no API key goes offline, and says why in one line
    env = {"WANDB_API_KEY": "", "NETRC": os.devnull}
    overrides = [o for o in SHORT if o != "wandb.mode=disabled"]
    result = moe_perf(ab_repo, *overrides, "wandb.mode=auto", "arm=base", env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "arm 1/1: base: main @ " in out
    assert "base: starting: one process, no torchrun: 1 rank, OMP_NUM_THREADS=1 each" in out
    assert re.search(r"\[base\] step 2/4 .* elapsed \d+:\d\d  ETA \d+:\d\d", out), out
    assert re.search(r"\[base\] step 1/4 .* ETA <\d+:\d\d", out), out  # an upper bound
    assert re.search(r"\[base\] step 4/4 .* elapsed \d+:\d\d$", out, re.M), out  # nothing left
    command = " ".join(["python -m moe_perf", *overrides, "wandb.mode=auto", "-m", "arm=base,feat"])
    assert f"measured one arm (base) and compared nothing; to compare base and feat run the " \
           f"sweep: {command}" in out  # fmt: skip
    wandb_lines = [line for line in out.splitlines() if line.startswith("[moe_perf] wandb")]
    assert len(wandb_lines) == 1, wandb_lines
    assert "wandb offline (wandb.mode=auto and no API key" in wandb_lines[0]
    assert not (sweep_dir(ab_repo) / "comparison.json").exists()


@pytest.mark.slow
def test_a_sweep_counts_arms_lists_its_files_and_ends_with_a_verdict(ab_repo):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # torchrun's banner
    result = run(ab_repo, "moe_perf", *SHORT, "mesh=ep2", "-m", "arm=base,feat", env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "OMP_NUM_THREADS environment variable" not in out + result.stderr  # no banner
    threads = max(1, (len(os.sched_getaffinity(0)) - 1) // 2)
    assert out.count(f"torchrun with 2 ranks, OMP_NUM_THREADS={threads} each") == 2
    assert "arm 1/2: base" in out and "arm 2/2: feat" in out
    assert out.index("arm 1/2: base") < out.index("[base] step 1/4") < out.index("arm 2/2: feat")

    sweep = sweep_dir(ab_repo)
    listed = out.split("[moe_perf] files written:", 1)[1]
    (top,) = [line for line in listed.splitlines() if line.strip().startswith(f"{sweep}/")]
    for name in ("comparison.json", "comparison.md", "comparison.png", "multirun.yaml",
                 ".moe_perf/sweep.json", ".moe_perf/identity/"):  # fmt: skip
        assert f" {name}" in top, top
    (arm_dir,) = (sweep / "tiny").glob("pp1-dp2-cp1-ep2-*-base")
    assert f"tiny/{arm_dir.name}/  config.yaml console.log metrics.json torchrun/" in listed
    tag = arm_dir.name.removesuffix("-base")
    assert re.search(rf"^\[moe_perf\] tiny {tag}: step time .*UNKNOWN", out, re.M), out
    assert out.index("files written:") < out.index(f"[moe_perf] tiny {tag}: step time")
    assert png_pixels(sweep / "comparison.png") == (1300, 380)  # one row: one (model, tag)


# ---- the picture -----------------------------------------------------------------------------


def arm_record(arm: str, repeat: int, step_s: float, failed: bool = False, sha: str = "a",
               tag: str = "pp1-dp1-cp1-ep1-seq64-fp32") -> ArmRecord:  # fmt: skip
    steps = [{"step": s, "step_time_s": step_s * (3 if s == 1 else 1 + 0.01 * (s % 3)),
              "tokens_per_s": 256 / step_s, "peak_mem_gib": 0.5, "loss": 5.0}
             for s in range(1, 3 if failed else 9)]  # fmt: skip
    return ArmRecord.from_dict({
        "schema": SCHEMA, "model": "tiny", "tag": tag, "arm": arm, "repeat": repeat,
        "sha": sha * 40, "ref": arm, "status": "failed" if failed else "ok",
        "exit_code": 1 if failed else 0,
        "failure": "trainer exited with code 1" if failed else None, "log": "console.log",
        "steps": steps, "summary": summarize(steps), "config": {}})  # fmt: skip


def draw(tmp_path: Path, records: list[ArmRecord]) -> tuple[Comparison, list[DrawnAxes]]:
    """The report of `records`, its comparison.png written, and what its figure draws."""
    report = compare_records(records)
    png = tmp_path / write_outputs(report, tmp_path).files["plot"]
    assert png_pixels(png) == (1300, 380 * len(report.groups))  # a row of 3 axes per group
    return report, [drawn(ax) for ax in figure(report).axes]


def drawn_steps(record: ArmRecord) -> tuple[list[float], list[float]]:
    """The line a run should get: its steps from 2 on (step 1 is warm-up) and their times."""
    steps = record.steps[1:]
    return [float(s.step) for s in steps], [s.step_time_s for s in steps]


def test_picture_of_an_ab_run(tmp_path):
    base, feat = arm_record("base", 0, 0.100), arm_record("feat", 0, 0.103, sha="b")
    report, (steps, tokens, memory) = draw(tmp_path, [base, feat])
    (group,) = report.groups
    assert re.fullmatch(r"tiny \S+: step time .*UNKNOWN.*", verdict(group))
    assert group.verdict["step_time_s"].estimate == pytest.approx(0.03)

    assert steps.title.startswith(f"tiny  {group.tag}\nstep time: step time UNKNOWN: +3.0%")
    assert (steps.xlabel, steps.ylabel) == ("step (step 1 not shown: warm-up)", "step time (s)")
    assert steps.lines["base r0"] == drawn_steps(base)
    assert steps.lines["feat r0"] == drawn_steps(feat)
    for arm in ("base", "feat"):
        median = group.arms[arm].figures["step_time_s"].median
        assert steps.lines[f"{arm} median {median:.4g} s"][1] == [median, median]
    assert steps.legend == list(steps.lines)  # every series named in the legend
    for ax, key in ((tokens, "tokens_per_s"), (memory, "peak_mem_gib")):
        assert ax.xticklabels == ["base", "feat"]
        assert ax.bars == [group.arms[arm].figures[key].median for arm in ("base", "feat")]
        assert [ys for _, ys in ax.points] == [[ax.bars[0]], [ax.bars[1]]]  # the one run each
    assert tokens.title == "tokens/s (median of runs)\nfeat -2.91%"
    assert memory.title == "peak memory GiB (max per run)\nfeat +0.00%"


def test_picture_of_a_repeat_sweep(tmp_path):
    records = [arm_record(arm, r, (0.100 if arm == "base" else 0.110) + 0.001 * r,
                          sha="a" if arm == "base" else "b")
               for r in range(3) for arm in ("base", "feat")]  # fmt: skip
    report, (steps, tokens, _) = draw(tmp_path, records)
    assert "DIFFERENT" in verdict(report.groups[0])
    for record in records:
        assert steps.lines[f"{record.arm} r{record.repeat}"] == drawn_steps(record)
    assert {"base spread of 3 runs", "feat spread of 3 runs"} <= set(steps.legend)
    assert len(tokens.points) == 6  # every run a dot beside its arm's bar
    assert [xs for xs, _ in tokens.points] == [[0.0]] * 3 + [[1.0]] * 3


def test_picture_of_an_aa_sweep_says_so(tmp_path):
    records = [arm_record(arm, r, 0.1 + 0.001 * r) for r in range(2) for arm in ("base", "feat")]
    report, (steps, _, _) = draw(tmp_path, records)
    text = verdict(report.groups[0])
    assert "SAME" in text and "A/A run" in text
    headline = steps.title.splitlines()[0]
    assert headline.endswith("A/A run: base and feat are one commit, any difference is noise")


def test_picture_of_a_sweep_with_a_failed_arm(tmp_path):
    records = [arm_record("base", 0, 0.1), arm_record("feat", 0, 0.1, failed=True, sha="b"),
               arm_record("base", 0, 0.2, tag="pp1-dp2-cp1-ep2-seq64-fp32"),
               arm_record("feat", 0, 0.21, sha="b", tag="pp1-dp2-cp1-ep2-seq64-fp32")]  # fmt: skip
    report, axes = draw(tmp_path, records)
    failed, ok = report.groups
    assert verdict(failed).endswith("not compared, no successful run of feat (1 of 2 runs failed)")
    assert "step time UNKNOWN: +5.0% (1 pair)" in verdict(ok)
    steps, tokens, memory = axes[:3]  # the first row: the group with the failed arm
    assert steps.lines["feat r0 FAILED"] == drawn_steps(records[1])  # its steps until it failed
    assert "feat median" not in " ".join(steps.lines)  # no median for an arm without a run
    for ax in (tokens, memory):
        assert ax.texts[-1] == "failed" and len(ax.bars) == 1  # base's bar only
    assert [ax.title.splitlines()[0] for ax in axes[3:]] == [
        "tiny  pp1-dp2-cp1-ep2-seq64-fp32", "tokens/s (median of runs)",
        "peak memory GiB (max per run)"]  # fmt: skip


# ---- progress and threads --------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_step_progress_eta_comes_from_the_measured_steps():
    clock = Clock()
    progress = StepProgress("feat", 10, clock=clock)
    clock.now += 30  # start-up and step 1
    first = progress.line({"step": 1, "step_time_s": 12.0, "tokens_per_s": 10.0,
                           "peak_mem_gib": 1.0})  # fmt: skip
    assert first.startswith("[feat] step 1/10  12.0000 s  10 tokens/s  peak 1.00 GiB")
    assert first.endswith("elapsed 0:30  ETA <1:48")  # 9 steps of step 1's 12 s, at most
    for step, gap in ((2, 5.0), (3, 7.0), (4, 5.0)):
        clock.now += gap
        line = progress.line({"step": step, "step_time_s": 5.0, "tokens_per_s": None,
                              "peak_mem_gib": None})  # fmt: skip
    assert "? tokens/s  peak ? GiB" in line
    assert line.endswith("elapsed 0:47  ETA 0:30")  # 6 steps left x the median gap of 5 s
    assert clock_time(3723) == "1:02:03"


def test_a_negative_loss_is_shown_and_a_nan_loss_is_unknown():
    reader = LogReader("contract")
    line = format_step(2, 8, step_time_s=0.5, tokens_per_s=10.0, peak_mem_gib=0.1, loss=-0.25)
    assert "loss -0.25  elapsed" in StepProgress("feat", 8).line(reader.feed(line))
    nan = format_step(3, 8, step_time_s=0.5, tokens_per_s=10.0, peak_mem_gib=0.1, loss=math.nan)
    assert reader.feed(nan)["loss"] is None


def test_rank_threads_split_the_cores_unless_the_environment_says(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    threads = RankThreads.for_launch(2)
    assert threads.env == {"OMP_NUM_THREADS": str(max(1, (cores - 1) // 2))}
    assert f"({cores} cores - 1 for the runner, / 2; set OMP_NUM_THREADS" in threads.describe()
    assert RankThreads.for_launch(1).threads == max(1, cores - 1)  # one core left to the runner
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    given = RankThreads.for_launch(8)
    assert given.env == {} and "OMP_NUM_THREADS=3 each (from your environment)" in given.describe()


# ---- a log format that reads nothing ---------------------------------------------------------

OWN_LINES = [f"iter {k} took {400 + k}.5 ms" for k in range(1, 6)]
NO_MATCH = r"step (?P<step>\d+) (?P<step_time_ms>[0-9.]+)ms"


def test_lines_like_steps_that_the_format_misses_are_said_at_the_third():
    watch = UnmatchedLines(NO_MATCH)
    startup = ["loading 3 shards", "model has 12,345 parameters", "[rank1]:iter 1 took 1 ms"]
    assert [watch.feed(line, step_line=False) for line in startup + OWN_LINES[:2]] == [None] * 5
    warning = watch.feed(OWN_LINES[2], step_line=False)
    assert f"trainer.log_format={NO_MATCH!r} has read no step" in warning
    assert f"e.g. {OWN_LINES[2]!r}" in warning and "no metrics" in warning
    assert watch.feed(OWN_LINES[3], step_line=False) is None  # said once
    read = UnmatchedLines(NO_MATCH)
    read.feed("step 1 400.0ms", step_line=True)
    assert [read.feed(line, step_line=False) for line in OWN_LINES] == [None] * 5


def test_lines_of_a_known_format_are_named():
    watch = UnmatchedLines("contract")
    titan = [f"[titan] 2026-07-17 12:05:0{k},000 - root - INFO - step: {k}  loss: 6.1  "
             f"memory: 4.26GiB(2.39%)  tps: 72,915" for k in (1, 2, 3)]  # fmt: skip
    warning = [watch.feed(line, step_line=False) for line in titan][-1]
    assert "that line reads as torchtitan's: trainer.log_format=torchtitan?" in warning


@pytest.mark.slow
def test_the_warning_comes_while_the_arm_runs(tmp_path):
    trainer = "import time\n" + "".join(f"print({line!r}, flush=True)\n" for line in OWN_LINES)
    trainer += "time.sleep(0.2)\nprint('the last line', flush=True)\n"
    console = io.StringIO()
    result = run_trainer([sys.executable, "-c", trainer], cwd=tmp_path, arm_dir=tmp_path,
                         label="base", timeout_s=60, kill_grace_s=5, max_steps=5,
                         one_process=True, echo=console, log_format=NO_MATCH)  # fmt: skip
    assert result.failure.startswith("no metrics")  # as before, at the end
    out = console.getvalue()
    assert "base: warning: trainer.log_format=" in out
    assert out.index("warning: trainer.log_format") < out.index("[base] the last line")
