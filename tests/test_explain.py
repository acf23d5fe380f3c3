"""explain=true: where each arm's step time goes, by category, read from real profiler traces.

Unit tests profile a small real training step on CPU with torch.profiler (dense matmuls, a
grouped GEMM inside the `moe_perf.experts` scope, attention, fused AdamW) and read the Chrome
trace back; the end-to-end tests run the real `python -m moe_perf ... explain=true` on the
reference trainer in a git repository whose feature branch plants extra work in one place.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

from moe_perf.report import explain

ROOT = Path(__file__).resolve().parents[1]
D, E, T = 64, 4, 256  # hidden, experts, tokens


class Step:
    """A small MoE-like training step: dense projections, attention, routed experts."""

    def __init__(self, extra_elementwise: int = 0, extra_expert_gemms: int = 0):
        g = torch.Generator().manual_seed(0)
        self.w_in = torch.randn(D, D, generator=g, requires_grad=True)
        self.w_e = torch.randn(E, D, D, generator=g, requires_grad=True)
        self.opt = torch.optim.AdamW([self.w_in, self.w_e], fused=True)
        self.extra_elementwise, self.extra_expert_gemms = extra_elementwise, extra_expert_gemms
        self.offs = torch.arange(1, E + 1, dtype=torch.int32) * (T // E)

    def __call__(self) -> None:
        x = torch.randn(T, D)
        h = x @ self.w_in
        q = h.view(4, T // 4, D).unsqueeze(1)
        h = h + F.scaled_dot_product_attention(q, q, q, is_causal=True).reshape(T, D)
        for _ in range(self.extra_elementwise):
            h = h * 1.0001
        with record_function(explain.EXPERT_SCOPE):
            y = torch._grouped_mm(h, self.w_e, offs=self.offs)
            for _ in range(self.extra_expert_gemms):
                y = torch._grouped_mm(y, self.w_e, offs=self.offs)
        (y.float() ** 2).mean().backward()
        self.opt.step()
        self.opt.zero_grad()


def profiled_trace(step: Step, steps: int, path: Path) -> Path:
    """Chrome trace of `steps` calls, each in its ProfilerStep#i span (as the trainer does)."""
    step()  # warm-up outside the trace
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            with record_function(f"ProfilerStep#{i}"):
                step()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return path


def arm_record(tmp_path: Path, arm: str, step: Step, steps: int = 5) -> dict:
    """A run's record whose arm dir holds a real explain/ trace, as the trainer leaves it."""
    arm_dir = tmp_path / arm
    profiled_trace(step, steps, arm_dir / "explain" / "trace_rank0.json")
    (arm_dir / "explain" / "steps.json").write_text(json.dumps({"steps": steps}))
    return {"arm": arm, "arm_dir": str(arm_dir), "status": "ok",
            "config": {"explain": True, "trainer": {"name": "reference"}}}  # fmt: skip


@pytest.fixture(scope="module")
def breakdown(tmp_path_factory) -> dict:
    path = profiled_trace(Step(), 3, tmp_path_factory.mktemp("trace") / "trace.json")
    return explain.trace_breakdown(explain.read_trace(path))


def test_a_real_cpu_trace_splits_into_steps_and_categories(breakdown):
    assert breakdown["device"] == "cpu" and breakdown["steps"] == 3
    assert breakdown["step_markers"] and breakdown["expert_scope"]
    cats = breakdown["categories"]
    for key in ("dense_gemm", "expert_gemm", "attention", "optimizer", "norms_elementwise"):
        assert min(cats[key]) > 0, key
    assert max(cats["all_to_all"]) == 0 and max(cats["collectives"]) == 0
    # self times plus the time outside any op add up to each step's span
    for i, span in enumerate(breakdown["step_ms"]):
        total = sum(values[i] for values in cats.values())
        assert total == pytest.approx(span, rel=0.02)


def test_backward_of_the_experts_is_expert_time(breakdown):
    """The backward ops have no scope; they are matched to the forward by sequence number."""
    names = breakdown["names"]
    backward = [n for n in names if "GroupedMmBackward0" in n]
    assert backward and all(n.endswith("[expert/grouped GEMM]") for n in backward)
    assert any(n.startswith("aten::mm [dense GEMM]") for n in names)  # x @ w_in and its grad
    assert any(n.startswith("aten::_fused_adamw_ [optimizer]") for n in names)


@pytest.mark.parametrize(
    ("chain", "in_experts", "key"),
    [
        (["aten::mm", "aten::matmul", "aten::linear"], False, "dense_gemm"),
        (["aten::mm", "aten::linear", "moe_perf.experts"], True, "expert_gemm"),
        (["aten::_grouped_mm"], False, "expert_gemm"),
        (["aten::t", "aten::linear"], False, "dense_gemm"),  # inner view: the GEMM's time
        (["aten::_scaled_dot_product_flash_attention_for_cpu"], False, "attention"),
        (["aten::copy_", "aten::to", "Optimizer.step#AdamW.step"], False, "optimizer"),
        (["aten::_foreach_norm"], False, "optimizer"),
        (["c10d::alltoall_base_"], False, "all_to_all"),
        (["record_param_comms", "c10d::allreduce_"], False, "collectives"),
        (["aten::_fused_rms_norm", "aten::rms_norm"], False, "norms_elementwise"),
        (["aten::silu"], False, "norms_elementwise"),
        (["aten::argsort"], False, "routing"),
        (["aten::copy_", "aten::_to_copy"], False, "copies"),
        (["aten::item"], False, "other"),
    ],
)
def test_categorize_cpu_op_chains(chain, in_experts, key):
    assert explain.categorize(chain, in_experts) == key


def test_a_planted_elementwise_pass_is_that_category(tmp_path):
    base = arm_record(tmp_path, "base", Step())
    feat = arm_record(tmp_path, "feat", Step(extra_elementwise=200))
    section = explain.explain_group([base, feat])
    rows = {r["category"]: r for r in section["categories"]}
    assert section["moved_most"] == "norms_elementwise"
    assert rows["norms_elementwise"]["beyond_noise"] and rows["norms_elementwise"]["delta_ms"] > 0
    assert not rows["expert_gemm"]["beyond_noise"]
    text = "\n".join(explain.markdown({"explain": section}))
    assert "Moved most: norms/elementwise" in text and "not the measured steps" in text


def test_an_a_a_pair_moves_no_category_beyond_its_noise(tmp_path):
    base = arm_record(tmp_path, "base", Step(), steps=7)
    feat = arm_record(tmp_path, "feat", Step(), steps=7)
    section = explain.explain_group([base, feat])
    moved = [r["label"] for r in section["categories"] if r["beyond_noise"]]
    assert moved == [], section["categories"]


def test_an_arm_without_traces_says_why(tmp_path):
    base = arm_record(tmp_path, "base", Step(), steps=2)
    feat = {"arm": "feat", "arm_dir": str(tmp_path / "nothing"), "status": "ok",
            "config": {"explain": True, "trainer": {"name": "command"}}}  # fmt: skip
    section = explain.explain_group([base, feat])
    assert "categories" not in section
    assert "cannot switch that trainer's profiler on" in section["missing"]["feat"]
    assert any("No breakdown for feat" in line for line in explain.markdown({"explain": section}))
