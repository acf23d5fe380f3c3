"""Routing in the records and the comparison: the per-step imbalance summarized, requested against
planned against measured, and the picture of step time against imbalance (what is drawn)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from helpers.command import moe_perf, sweep_dir
from helpers.repos import make_repo

from moe_perf.common.contract import format_step
from moe_perf.common.routing import skew_plan
from moe_perf.report import comparison as compare
from moe_perf.report import imbalance
from moe_perf.report.record import summarize

ROOT = Path(__file__).resolve().parents[1]
TINY = yaml.safe_load((ROOT / "conf" / "model" / "tiny.yaml").read_text())
TINY.pop("defaults")
MESH_TAG = "pp1-dp4-cp1-ep4-seq64-fp32"
# ep4, 64 tokens per rank micro-batch: the plan the trainer would make for these configs
TRAINING = {"sequence_length": 64, "global_batch": 8, "micro_batch": 1, "max_steps": 5}


def plan(imbalance_: float):
    return skew_plan(num_experts=8, top_k=2, tokens=64, ep=4, imbalance=imbalance_)


def config(routing: dict) -> dict:
    return {"model": TINY, "mesh": {"nnodes": 1, "nproc_per_node": 4, "pp": 1, "cp": 1, "ep": 4},
            "dtype": {"name": "fp32"}, "training": TRAINING, "routing": routing}  # fmt: skip


def write_arm(sweep: Path, arm: str, repeat: int, tag: str, routing: dict, step_s: float,
              measured: tuple[float, float] | None) -> None:  # fmt: skip
    """An arm as the runner writes it: console.log with the trainer's step lines, metrics.json
    read from it (comparison.record_from_log) with the arm's config."""
    arm_dir = sweep / "tiny" / f"{tag}-{arm}-r{repeat}"
    arm_dir.mkdir(parents=True)
    extra = dict(zip(("expert_imbalance", "rank_imbalance"), measured or (), strict=False))
    lines = [format_step(s, 5, step_time_s=step_s * (3 if s == 1 else 1),
                         tokens_per_s=512 / step_s, peak_mem_gib=1.0, **extra)
             for s in range(1, 6)]  # fmt: skip
    (arm_dir / "console.log").write_text("\n".join(lines) + "\n")
    record = compare.record_from_log(arm_dir / "console.log", arm, "contract")
    sha = "a" * 40 if arm == "base" else "b" * 40
    record = dataclasses.replace(record, model="tiny", tag=tag, repeat=repeat, sha=sha,
                                 sweep_id="s1", config={**config(routing), "arm": {"name": arm},
                                                        "repeat": repeat})  # fmt: skip
    record.dump(arm_dir / "metrics.json")


def skew_sweep(sweep: Path) -> None:
    """routing=skew -m routing.imbalance=1,2,4 repeat=0,1 arm=base,feat; feat slows with skew."""
    for r in (1.0, 2.0, 4.0):
        p = plan(r)
        for arm, repeat in ((a, i) for a in ("base", "feat") for i in (0, 1)):
            step_s = 0.1 * (1 + (r - 1) * (0.05 if arm == "base" else 0.2)) + 0.001 * repeat
            write_arm(sweep, arm, repeat, f"{MESH_TAG}-skew{r:.1f}",
                      {"mode": "skew", "imbalance": r, "shape": "hot", "hot_experts": 1,
                       "hot_ranks": 1}, step_s,
                      (p.expert_imbalance, p.rank_imbalance))  # fmt: skip


def test_the_summary_holds_the_median_imbalance_only_where_a_trainer_printed_it():
    steps = [{"step": i, "step_time_s": 1.0, "expert_imbalance": e, "rank_imbalance": 1.0}
             for i, e in enumerate((9.0, 1.5, 1.3, 1.4), start=1)]  # fmt: skip
    summary = summarize(steps)
    assert summary["expert_imbalance"] == 1.4 and summary["rank_imbalance"] == 1.0
    assert "expert_imbalance" not in summarize([{"step": 1, "step_time_s": 1.0}] * 2)


@pytest.mark.slow
def test_each_imbalance_is_a_group_with_requested_planned_and_measured(tmp_path):
    skew_sweep(tmp_path)
    report, text = compare.compare_sweep(tmp_path)
    groups = {g.tag: g for g in report.groups}
    assert sorted(groups) == [f"{MESH_TAG}-skew{r}" for r in ("1.0", "2.0", "4.0")]
    section = groups[f"{MESH_TAG}-skew2.0"].routing
    assert section["mode"] == "skew" and section["requested"]["imbalance"] == 2.0
    assert section["planned"] == {"expert_imbalance": 2.0, "rank_imbalance": plan(2).rank_imbalance}
    assert section["achieved"]["feat"]["runs"] == 2
    assert section["achieved"]["base"]["expert_imbalance"]["median"] == 2.0
    assert section["matches_plan"] is True and section["plot"] == imbalance.PLOT_NAME
    rank = f"{plan(2).rank_imbalance:.4g}"
    assert "### Routing: skew (imbalance 2.0, shape hot, 1 hot expert(s), hot experts on 1 EP " \
           "rank(s))" in text  # fmt: skip
    assert f"| planned (whole slot counts) | 2 | {rank} |" in text
    assert f"| feat, measured | 2 [2-2] | {rank} [{rank}-{rank}] |" in text
    assert "Every run measured exactly the planned imbalance." in text
    assert (tmp_path / imbalance.PLOT_NAME).read_bytes().startswith(b"\x89PNG")


def test_a_run_off_its_plan_is_said_and_real_routing_asks_for_repeats(tmp_path):
    routing = {"mode": "skew", "imbalance": 2.0, "shape": "hot", "hot_experts": 1, "hot_ranks": 1}
    write_arm(tmp_path, "base", 0, f"{MESH_TAG}-skew2.0", routing, 0.1, (1.9, 1.0))
    write_arm(tmp_path, "feat", 0, f"{MESH_TAG}-skew2.0", routing, 0.1, None)
    write_arm(tmp_path, "base", 0, f"{MESH_TAG}-real", {"mode": "real"}, 0.1, (1.31, 1.02))
    write_arm(tmp_path, "feat", 0, f"{MESH_TAG}-real", {"mode": "real"}, 0.1, (1.29, 1.03))
    write_arm(tmp_path, "base", 0, MESH_TAG, {"mode": "balanced"}, 0.1, (1.0, 1.0))
    write_arm(tmp_path, "feat", 0, MESH_TAG, {"mode": "balanced"}, 0.1, (1.0, 1.0))
    report, text = compare.compare_sweep(tmp_path, write=False)
    groups = {g.tag: g for g in report.groups}
    assert groups[MESH_TAG].routing is None  # balanced: the comparison as it always was
    assert "routing" not in groups[MESH_TAG].to_dict()
    assert groups[f"{MESH_TAG}-skew2.0"].routing["matches_plan"] is False
    assert "| feat, measured | not reported | not reported |" in text
    assert "Warning: a run measured another imbalance than the plan's." in text
    real = groups[f"{MESH_TAG}-real"].routing
    assert real["planned"] is None
    assert real["achieved"]["base"]["expert_imbalance"]["median"] == 1.31
    assert "### Routing: real (the router's own top-k, seeded)" in text
    assert "compare with repeats" in text
    assert imbalance.figure(report) is None  # one imbalance: no curve to draw


def test_the_picture_draws_step_time_and_tokens_per_s_against_imbalance(tmp_path):
    skew_sweep(tmp_path)
    report, _ = compare.compare_sweep(tmp_path, write=False)
    fig = imbalance.figure(report)
    step_ax, tokens_ax = fig.axes
    # the row's title over its left panel alone, so it never runs into the right one's
    assert step_ax.get_title(loc="left") == f"tiny  {MESH_TAG}-skew*"
    assert tokens_ax.get_title(loc="left") == tokens_ax.get_title() == ""
    for ax, key, unit in ((step_ax, "step_time_s", "step time (s)"),
                          (tokens_ax, "tokens_per_s", "tokens/s")):  # fmt: skip
        assert ax.get_xlabel() == "routing.imbalance (busiest expert / mean)"
        assert ax.get_ylabel() == unit and list(ax.get_xticks()) == [1.0, 2.0, 4.0]
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert sorted(lines) == ["base (median of 2 run(s))", "feat (median of 2 run(s))"]
        for arm in ("base", "feat"):
            line = lines[f"{arm} (median of 2 run(s))"]
            groups = sorted(report.groups, key=lambda g: g.tag)
            assert list(line.get_xdata()) == [1.0, 2.0, 4.0]
            assert list(line.get_ydata()) == [g.arms[arm].figures[key].median for g in groups]
        spreads = [c.get_label() for c in ax.collections]
        assert spreads == ["base min-max of runs", "feat min-max of runs"]
    step = {line.get_label()[:4]: line.get_ydata() for line in step_ax.get_lines()}
    assert step["feat"][-1] / step["feat"][0] > step["base"][-1] / step["base"][0]


@pytest.mark.slow
def test_a_sweep_over_the_imbalance_with_the_reference_trainer(tmp_path):
    """The real command: routing=skew over two imbalances, both arms, on CPU; one pair per
    imbalance (an A/A of 3 steps: pairs until decided ran up to 10 in each cell)."""
    repo = make_repo(tmp_path / "repo")
    result = moe_perf(repo, "routing=skew", "mesh=ep2", "training.sequence_length=64",
                      "training.global_batch=4", "training.max_steps=3", "wandb.mode=disabled",
                      "compare.max_pairs=1", "-m", "routing.imbalance=1,2", "arm=base,feat",
                      timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(p.read_text()) for p in sweep_dir(repo).rglob("metrics.json")]
    assert sorted({r["tag"] for r in records}) == [
        "pp1-dp2-cp1-ep2-seq64-fp32-skew1.0", "pp1-dp2-cp1-ep2-seq64-fp32-skew2.0"]  # fmt: skip
    for record in records:
        r = record["config"]["routing"]["imbalance"]
        assert all(s["expert_imbalance"] == pytest.approx(r) for s in record["steps"])
        assert record["summary"]["expert_imbalance"] == pytest.approx(r)
    text = (sweep_dir(repo) / "comparison.md").read_text()
    assert text.count("Every run measured exactly the planned imbalance.") == 2
    assert (sweep_dir(repo) / imbalance.PLOT_NAME).exists()
    assert imbalance.PLOT_NAME in result.stdout  # listed with the sweep's files
