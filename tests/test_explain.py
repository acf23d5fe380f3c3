"""explain=true: where each arm's step time goes, by category, read from real profiler traces.

Unit tests profile a small real training step on CPU with torch.profiler (dense matmuls, a
grouped GEMM inside the `moe_perf.experts` scope, attention, fused AdamW) and read the Chrome
trace back; the end-to-end tests run the real `python -m moe_perf ... explain=true` on the
reference trainer in a git repository whose feature branch plants extra work in one place.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.command import moe_perf
from helpers.repos import git, make_repo
from torch.profiler import ProfilerActivity, profile, record_function

from moe_perf.common.explain import EXPLAIN_STEPS
from moe_perf.report import explain, render_explain
from moe_perf.report.results import ArmRecord

ROOT = Path(__file__).resolve().parents[1]
CPU_SIZES = dict(dim=128, experts=4, tokens=2048, dtype=torch.float32)
GPU_SIZES = dict(dim=2048, experts=8, tokens=16384, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-process group (gloo, and nccl on a GPU), so a step has a real all-to-all."""
    import torch.distributed as dist

    if dist.is_initialized():  # another test's group: use it as it is
        yield
        return
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Step:
    """A small MoE-like training step: a dense projection, attention, an all-to-all dispatch
    (with a process group), routed experts as one grouped GEMM, fused AdamW."""

    def __init__(self, device="cpu", dim=64, experts=4, tokens=256, dtype=torch.float32,
                 extra_elementwise=0, extra_expert_gemms=0):  # fmt: skip
        g = torch.Generator(device).manual_seed(0)
        self.shape, self.device, self.dtype = (tokens, dim), device, dtype
        self.w_in = torch.randn(dim, dim, generator=g, device=device, requires_grad=True)
        self.w_e = torch.randn(experts, dim, dim, generator=g, device=device, requires_grad=True)
        self.opt = torch.optim.AdamW([self.w_in, self.w_e], fused=True)
        self.extra_elementwise, self.extra_expert_gemms = extra_elementwise, extra_expert_gemms
        step = tokens // experts
        self.offs = torch.arange(1, experts + 1, dtype=torch.int32, device=device) * step

    def __call__(self) -> None:
        import torch.distributed as dist
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        T, D = self.shape
        x = torch.randn(T, D, device=self.device, dtype=self.dtype)
        h = x @ self.w_in.to(self.dtype)
        q = h.view(4, T // 4, D // 64, 64).transpose(1, 2)
        h = h + F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(
            T, D
        )
        for _ in range(self.extra_elementwise):
            h.mul_(1.0001)  # in place: no allocation (and page faults) per pass
        if dist.is_initialized():
            h = all_to_all_single_autograd(h, None, None, dist.group.WORLD)
        w_e = self.w_e.to(self.dtype)
        with record_function(explain.EXPERT_SCOPE):
            y = torch._grouped_mm(h, w_e, offs=self.offs)
            for _ in range(self.extra_expert_gemms):
                y = torch._grouped_mm(y, w_e, offs=self.offs)
        (y.float() ** 2).mean().backward()
        self.opt.step()
        self.opt.zero_grad()
        if self.device != "cpu":
            torch.cuda.synchronize()  # the trainer's step ends on a device sync too


def profiled_trace(step: Step, steps: int, path: Path) -> Path:
    """Chrome trace of `steps` calls, each in its ProfilerStep#i span (as the trainer does)."""
    step()  # warm-up outside the trace
    activities = [ProfilerActivity.CPU]
    if step.device != "cpu":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for i in range(steps):
            with record_function(f"ProfilerStep#{i}"):
                step()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return path


def arm_record(tmp_path: Path, arm: str, step: Step, steps: int = 5,
               repeat: int = 0) -> ArmRecord:  # fmt: skip
    """A run's record whose arm dir holds a real explain/ trace, as the trainer leaves it."""
    arm_dir = tmp_path / f"{arm}-r{repeat}"
    profiled_trace(step, steps, arm_dir / "explain" / "trace_rank0.json")
    (arm_dir / "explain" / "steps.json").write_text(json.dumps({"steps": steps}))
    return ArmRecord(arm=arm, arm_dir=str(arm_dir),
                     config={"explain": True, "trainer": {"name": "reference"}})  # fmt: skip


@pytest.fixture(scope="module")
def breakdown(tmp_path_factory, one_rank_group) -> dict:
    path = profiled_trace(Step(**CPU_SIZES), 3, tmp_path_factory.mktemp("trace") / "trace.json")
    return explain.trace_breakdown(explain.read_trace(path))


def test_a_real_cpu_trace_splits_into_steps_and_categories(breakdown):
    assert breakdown["device"] == "cpu" and breakdown["steps"] == 3
    assert breakdown["step_markers"] and breakdown["expert_scope"]
    cats = breakdown["categories"]
    for key in ("dense_gemm", "expert_gemm", "attention", "optimizer", "norms_elementwise"):
        assert min(cats[key]) > 0, key
    assert min(cats["all_to_all"]) > 0  # gloo's all_to_all_single
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


@pytest.mark.slow
def test_a_planted_elementwise_pass_is_that_category(tmp_path):
    # 1200 passes, about 150 ms a step here: 600 (75 ms) was once inside the noise of a run
    # with two descheduled steps of five under another worker's load. The noise is the widest
    # per-step range, so one step that another process doubled (a CI run: feat 222 ms a step, a
    # range above that) hides even this; a try is then taken again, three at most, and the
    # category that moved most is asserted on every try.
    for attempt in range(3):
        base = arm_record(tmp_path / f"try{attempt}", "base", Step(**CPU_SIZES))
        feat = arm_record(tmp_path / f"try{attempt}", "feat",
                          Step(**CPU_SIZES, extra_elementwise=1200))  # fmt: skip
        section = explain.explain_group([base, feat])
        rows = {r["category"]: r for r in section["categories"]}
        assert section["moved_most"] == "norms_elementwise"
        row = rows["norms_elementwise"]
        # under another worker's load the other categories move too: 2.9x seen in a CI try
        skip = ("norms_elementwise", "host_idle")
        others = [r["delta_ms"] for k, r in rows.items() if k not in skip]
        if row["beyond_noise"] and row["delta_ms"] > 2 * max(abs(d) for d in others):
            break
    else:
        pytest.fail(f"three tries, the planted pass never beyond its noise: {row}")
    assert row["delta_ms"] > 0
    text = "\n".join(render_explain.markdown(section))
    assert "Moved most: norms/elementwise" in text and "not the measured steps" in text


def test_an_a_a_pair_moves_no_category_beyond_its_noise(tmp_path):
    """Two interleaved runs per arm, as `-m repeat=0,1 arm=base,feat` runs them: the noise
    then holds the run-to-run spread of this shared machine, not only the per-step one."""
    records = [arm_record(tmp_path, arm, Step(**CPU_SIZES), steps=5, repeat=r)
               for r in (0, 1) for arm in ("base", "feat")]  # fmt: skip
    section = explain.explain_group(records)
    assert section["arms"]["base"]["runs"] == 2
    moved = [r["label"] for r in section["categories"] if r["beyond_noise"]]
    assert moved == [], section["categories"]
    floor = explain.NOISE_FLOOR_CPU * section["arms"]["base"]["step_ms"]["median"]
    assert min(r["noise_ms"] for r in section["categories"]) >= floor  # a CPU trace's floor


def test_an_arm_without_traces_says_why(tmp_path):
    base = arm_record(tmp_path, "base", Step(**CPU_SIZES), steps=2)
    feat = ArmRecord(arm="feat", arm_dir=str(tmp_path / "nothing"),
                     config={"explain": True, "trainer": {"name": "command"}})  # fmt: skip
    section = explain.explain_group([base, feat])
    assert "categories" not in section
    assert "cannot switch that trainer's profiler on" in section["missing"]["feat"]
    assert any("No breakdown for feat" in line for line in render_explain.markdown(section))


def h200_record(tmp_path: Path, arm: str) -> ArmRecord:
    """A record whose explain/ holds a trace taken on an H200 by the GPU test below (3 steps
    of Step("cuda", **GPU_SIZES); feat with 2 extra grouped GEMMs), kept in tests/data."""
    arm_dir = tmp_path / arm
    (arm_dir / "explain").mkdir(parents=True)
    data = gzip.decompress((ROOT / "tests" / "data" / f"h200_{arm}_trace.json.gz").read_bytes())
    (arm_dir / "explain" / "trace_rank0.json").write_bytes(data)
    return ArmRecord(arm=arm, arm_dir=str(arm_dir),
                     config={"explain": True, "trainer": {"name": "reference"}})  # fmt: skip


@pytest.mark.parametrize(
    ("kernel", "key"),
    [
        (
            "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13"
            "GemmUniversalINS5_17GroupProblem",
            "expert_gemm",
        ),
        ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "dense_gemm"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention"),
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "all_to_all"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<", "optimizer"),
        (
            "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::"
            "BFloat16>",
            "norms_elementwise",
        ),
        (
            "void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel",
            "copies",
        ),
        ("GPU idle in the step", "host_idle"),
    ],
)
def test_an_h200_trace_attributes_each_kernel(tmp_path, kernel, key):
    """Real H200 kernels, attributed through the CPU op that launched them."""
    trace = explain.read_trace(Path(h200_record(tmp_path, "base").arm_dir) / "explain" /
                               "trace_rank0.json")  # fmt: skip
    b = explain.trace_breakdown(trace)
    assert b["device"] == "cuda" and b["steps"] == 3 and b["expert_scope"]
    found = [n for n in b["names"] if n.startswith(kernel)]
    assert found and all(n.endswith(f"[{explain.LABELS[key]}]") for n in found), found
    assert min(b["categories"][key]) > 0


def test_h200_traces_find_the_planted_expert_gemms(tmp_path):
    section = explain.explain_group([h200_record(tmp_path, "base"), h200_record(tmp_path, "feat")])
    rows = {r["category"]: r for r in section["categories"]}
    assert section["moved_most"] == "expert_gemm" and rows["expert_gemm"]["beyond_noise"]
    assert rows["expert_gemm"]["pct"] > 150  # 1 grouped GEMM forward + 2 backward -> 3 + 2
    for key in ("dense_gemm", "attention", "optimizer"):
        assert not rows[key]["beyond_noise"], rows[key]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_kernels_are_attributed_and_a_planted_expert_gemm_found(tmp_path, one_rank_group):
    """Real CUDA kernels: each attributed through its launching op (grouped GEMM kernels in the
    experts' scope are expert GEMM), NCCL's all-to-all, the GPU's idle time in the step."""
    base = arm_record(tmp_path, "base", Step("cuda", **GPU_SIZES), steps=6)
    feat = arm_record(tmp_path, "feat", Step("cuda", **GPU_SIZES, extra_expert_gemms=2), steps=6)
    trace = explain.read_trace(Path(base.arm_dir) / "explain" / "trace_rank0.json")
    b = explain.trace_breakdown(trace)
    assert b["device"] == "cuda" and b["steps"] == 6
    for key in ("dense_gemm", "expert_gemm", "attention", "all_to_all", "optimizer"):
        assert min(b["categories"][key]) > 0, key
    section = explain.explain_group([base, feat])
    print("\n".join(render_explain.markdown(section)))
    rows = {r["category"]: r for r in section["categories"]}
    assert section["moved_most"] == "expert_gemm"
    assert rows["expert_gemm"]["beyond_noise"] and rows["expert_gemm"]["pct"] > 50
    assert not rows["attention"]["beyond_noise"] and not rows["dense_gemm"]["beyond_noise"]


# ---- external trainers' profilers ------------------------------------------------------------


def external_cfg(trainer: str, max_steps: int = 8, explain_on: bool = True):
    from omegaconf import OmegaConf

    return OmegaConf.create({
        "explain": explain_on, "trainer": {"name": trainer},
        "training": {"max_steps": max_steps}, "mesh": {"nnodes": 1, "nproc_per_node": 4},
    })  # fmt: skip


@pytest.mark.slow
def test_torchtitan_profiles_its_last_measured_steps_into_the_arm_dir(tmp_path):
    from moe_perf.frameworks.torchtitan import profiling_flags

    assert profiling_flags(external_cfg("torchtitan", explain_on=False), tmp_path) == []
    flags = profiling_flags(external_cfg("torchtitan"), tmp_path)
    config_manager = pytest.importorskip("torchtitan.config").ConfigManager
    prof = config_manager().parse_args(flags).profiling
    assert prof.enable_profiling and prof.save_traces_folder == str(tmp_path / "explain")
    # torchtitan's schedule: wait = freq - (warmup + active), then warm-up, then active steps
    wait = prof.profile_freq - (prof.profiler_warmup + prof.profiler_active)
    assert wait >= 0 and prof.profile_freq == 8 and prof.profiler_active == EXPLAIN_STEPS


def test_megatron_profiles_every_rank_over_its_last_iterations(tmp_path):
    from moe_perf.frameworks.megatron import profiling_flags

    flags = profiling_flags(external_cfg("megatron"), tmp_path)
    assert flags[:2] == ["--profile", "--use-pytorch-profiler"]
    value = {flags[i]: flags[i + 1] for i in range(len(flags) - 1) if flags[i].startswith("--")}
    assert (value["--profile-step-start"], value["--profile-step-end"]) == ("4", "8")
    assert flags[flags.index("--profile-ranks") + 1 : flags.index("--tensorboard-dir")] == [
        "0", "1", "2", "3"]  # fmt: skip
    assert value["--tensorboard-dir"] == str(tmp_path / "explain")
    assert profiling_flags(external_cfg("megatron", max_steps=1), tmp_path) == []


def test_traces_of_each_trainer_are_found(tmp_path):
    for name in ("trace_rank0.json", "iteration_8/rank1_trace.json", "host_12.345.pt.trace.json"):
        (tmp_path / "explain" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "explain" / name).write_text("{}")
    found = [p.relative_to(tmp_path / "explain").as_posix() for p in explain.trace_files(tmp_path)]
    assert sorted(found) == ["host_12.345.pt.trace.json", "iteration_8/rank1_trace.json",
                             "trace_rank0.json"]  # fmt: skip


# ---- the real command ------------------------------------------------------------------------

EXPERT_RETURN = "return expert_bmm(h_LJF, w2).view(x_ND.shape[0], -1)"
SMALL = ["dtype=fp32", "training.sequence_length=64", "training.global_batch=4",
         "training.max_steps=3", "trainer.explain_steps=5", "wandb.mode=disabled",
         "compare.max_pairs=1",
         "timeout_s=300", "explain=true"]  # fmt: skip


def repo_with_this_trainer(path: Path) -> Path:
    """A repository holding this project's package, so each arm runs its own trainer code."""
    sources = [p for p in (ROOT / "moe_perf").rglob("*.py") if "__pycache__" not in p.parts]
    files = {str(p.relative_to(ROOT)): p.read_text() for p in sources}
    files[".gitignore"] = "__pycache__/\n"
    return make_repo(path, files)


def plant_expert_gemms(repo: Path, extra: int) -> None:
    """A feature commit: `extra` more expert matmuls in the routed experts' forward (the
    batched path forced balance takes)."""
    (file,) = [p for p in (repo / "moe_perf" / "trainer").glob("*.py")
               if EXPERT_RETURN in p.read_text()]  # fmt: skip
    lines = file.read_text().splitlines(keepends=True)
    (at,) = [i for i, line in enumerate(lines) if EXPERT_RETURN in line]
    pad = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
    lines[at:at] = [f"{pad}for _ in range({extra}):  # planted: work in one known place\n",
                    f"{pad}    expert_bmm(x_LJD, w13[..., : self.ffn])\n"]  # fmt: skip
    git(repo, "checkout", "-q", "-b", "more-expert-work")
    file.write_text("".join(lines))
    git(repo, "commit", "-q", "-am", f"plant {extra} extra expert matmuls in the experts")


def explain_section(cwd: Path) -> tuple[dict, str]:
    result_dir = cwd / "outputs" / "validate-performance"
    (group,) = json.loads((result_dir / "comparison.json").read_text())["groups"]
    return group["explain"], (result_dir / "comparison.md").read_text()


@pytest.mark.slow
def test_planted_expert_gemms_show_up_as_expert_gemm_time(tmp_path):
    repo = repo_with_this_trainer(tmp_path / "repo")
    # 96 extra matmuls: with 48 (about 6 ms a step) a drift of the shared machine's load moved
    # another category by 3.3 ms once, between the two runs (CI, beside the other test worker)
    plant_expert_gemms(repo, extra=96)
    result = moe_perf(tmp_path, f"repo={repo}", *SMALL, "-m", "arm=base,feat", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    section, md = explain_section(tmp_path)
    rows = {r["category"]: r for r in section["categories"]}
    assert section["moved_most"] == "expert_gemm", section["categories"]
    assert rows["expert_gemm"]["delta_ms"] > 0 and rows["expert_gemm"]["beyond_noise"]
    # one run per arm: a drift of the machine's load between the runs can move every category
    # a little; the planted one moves far more than any other
    others = [abs(r["delta_ms"]) for k, r in rows.items() if k != "expert_gemm"]
    assert rows["expert_gemm"]["delta_ms"] > 2 * max(others)
    assert section["arms"]["base"]["steps_profiled"] == 4  # the first of 5 dropped
    assert "Moved most: expert/grouped GEMM" in md and "not the measured steps" in md
    assert "Moved most: expert/grouped GEMM" in result.stdout
    assert (tmp_path / "outputs" / "validate-performance" / section["plot"]).is_file()
    # the profiler's start and stop markers (kineto's `USDT: ... profiler_start`) are in the
    # arms' console.log, not on the console
    logs = list((tmp_path / "outputs" / "validate-performance").glob("tiny/*/console.log"))
    assert len(logs) == 2 and all("] profiler_start" in log.read_text() for log in logs)
    assert "profiler_start" not in result.stdout + result.stderr
    for arm in ("base", "feat"):  # the measured steps are only the measured ones
        arm_dir = tmp_path / "outputs" / "validate-performance" / "tiny"
        (record,) = [json.loads(p.read_text()) for p in arm_dir.glob(f"*-{arm}/metrics.json")]
        assert [s["step"] for s in record["steps"]] == [1, 2, 3]
        assert record["config"]["trainer"]["explain_steps"] == 5


@pytest.mark.slow
def test_an_a_a_sweep_moves_no_category_beyond_its_noise(tmp_path):
    """Repeated and interleaved, so the noise holds the run-to-run spread as well (one run per
    arm would leave out any drift of this shared machine's load between the two runs). Three
    runs per arm: with two, under the other test worker's load, both of one arm's runs fell in
    a busier stretch once (expert GEMM -5.8 ms against a noise of 2.7 ms, a 90 ms step)."""
    repo = make_repo(tmp_path / "repo")  # no trainer code: both arms run the installed one
    result = moe_perf(repo, *SMALL, "-m", "repeat=0,1,2", "arm=base,feat", timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    section, md = explain_section(repo)
    moved = [(r["label"], r["delta_ms"], r["noise_ms"]) for r in section["categories"]
             if r["beyond_noise"]]  # fmt: skip
    assert moved == [], [(r["label"], r["base_ms"], r["feat_ms"], r["noise_ms"])
                         for r in section["categories"]]  # fmt: skip
    assert "no category moved beyond noise" in md


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([10.0, 11.0, 12.0], 2.0),  # under 4 steps: the whole range
        ([10.0, 11.0, 12.0, 40.0], 2.0),  # one descheduled step dropped
        ([10.0, 11.0, 12.0, 1.0], 2.0),  # a fast outlier too
        ([10.0, 11.0, 30.0, 40.0, 12.0], 20.0),  # only the one farthest: two slow steps stay wide
    ],
)
def test_noise_drops_only_the_one_step_farthest_from_the_median(values, expected):
    assert explain.spread(values) == pytest.approx(expected)


@pytest.fixture(scope="module")
def aa_section(tmp_path_factory, one_rank_group) -> dict:
    tmp_path = tmp_path_factory.mktemp("aa")
    records = [arm_record(tmp_path, arm, Step(**CPU_SIZES), steps=5) for arm in ("base", "feat")]
    return explain.explain_group(records)


def test_the_table_says_where_the_noise_is_the_floor_and_why(aa_section):
    table = render_explain.markdown(aa_section)
    floor = explain.NOISE_FLOOR_CPU * aa_section["arms"]["base"]["step_ms"]["median"]
    for row in aa_section["categories"]:
        if row["base_ms"] or row["feat_ms"]:
            line = next(x for x in table if x.startswith(f"| {row['label']} |"))
            at_floor = row["noise_ms"] == pytest.approx(floor)
            assert line.endswith(f"| {row['noise_ms']:.3f} (floor) |") == at_floor, line
    (note,) = [x for x in table if x.startswith("`(floor)`")]
    assert "3.0% of the base step" in note and "between processes" in note


def test_the_table_says_why_the_categories_do_not_add_up_to_the_step(aa_section):
    table = render_explain.markdown(aa_section)
    arms = aa_section["arms"]
    added = {a: sum(c["median"] for c in arms[a]["categories"].values()) for a in arms}
    row = next(x for x in table if x.startswith("| categories added up |"))
    assert row.startswith(f"| categories added up | {added['base']:.3f} | {added['feat']:.3f} |")
    (why,) = [x for x in table if "medians of the parts" in x]
    step = arms["base"]["step_ms"]["median"]
    assert f"base's add up to {added['base']:.1f} ms against a {step:.1f} ms profiled step" in why
