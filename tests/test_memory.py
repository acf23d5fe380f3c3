"""The memory pre-flight: the estimate (moe_perf/common/memory.py) against the peaks the real
trainer reports on CPU (fp32 and bf16, one process: its RSS), and a run that cannot fit refused
before launch with the overrides that would fit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.command import moe_perf
from helpers.compose import composed
from omegaconf import OmegaConf

from moe_perf.common import contract, memory
from moe_perf.common.config import Config, config_from_dict
from moe_perf.runner import preflight

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 0.10  # measured on an AMD EPYC (2 cores): -4% and +1.5% for the two cases below
# in fp32, -6.5% and -2.6% in bf16

CASES = {
    # weights, gradients and AdamW states dominate: 64 experts, a few tokens
    "weights": (
        {"vocab_size": 2048, "hidden": 256, "num_layers": 2, "num_experts": 64, "top_k": 2,
         "expert_ffn": 512, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64},
        {"sequence_length": 64, "global_batch": 2},
    ),
    # activations and logits dominate: 4096 tokens in one micro-batch
    "activations": (
        {"vocab_size": 8192, "hidden": 128, "num_layers": 2, "num_experts": 8, "top_k": 4,
         "expert_ffn": 256, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32},
        {"sequence_length": 512, "global_batch": 8, "micro_batch": 8},
    ),
}  # fmt: skip


def trainer_config(model: dict, training: dict) -> dict:
    preset = yaml.safe_load((ROOT / "conf" / "model" / "tiny.yaml").read_text())
    preset.pop("defaults", None)
    return {
        "model": {**preset, **model},
        "dtype": {"name": "fp32"},
        "training": {"device": "cpu", "max_steps": 2, **training},
        "trainer": {"name": "reference"},
    }


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # bf16: compute copies over fp32 masters
@pytest.mark.parametrize("case", list(CASES))
def test_the_estimate_matches_the_measured_peak_on_cpu(tmp_path, case, dtype):
    raw = {**trainer_config(*CASES[case]), "dtype": {"name": dtype}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    proc = subprocess.run(
        [sys.executable, "-m", "moe_perf.trainer", str(path)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    steps = [s for s in map(contract.parse_step, proc.stdout.splitlines()) if s]
    measured = max(s["peak_mem_gib"] for s in steps)  # the process's own peak RSS (VmHWM) on CPU
    estimated = memory.estimate(config_from_dict(raw), "cpu")
    assert measured > 0.9, "a case too small to test the estimate"
    assert abs(estimated.gib() / measured - 1) <= TOLERANCE, (estimated.breakdown(), measured)


def test_the_parts_follow_the_mesh_and_checkpointing():
    raw = trainer_config(*CASES["weights"])
    single = memory.estimate(config_from_dict(raw), "cuda")
    ep4 = memory.estimate(config_from_dict({**raw, "mesh": {"nproc_per_node": 4, "ep": 4}}), "cuda")
    assert ep4.optimizer < single.optimizer / 3  # experts split 4 ways, the rest FSDP over 4
    model, training = CASES["activations"]
    acts = trainer_config({**model, "num_layers": 8}, training)
    full = {**acts, "trainer": {"activation_checkpointing": "full"}}
    saved = memory.estimate(config_from_dict(acts), "cpu").activations
    assert memory.estimate(config_from_dict(full), "cpu").activations < saved / 4


def host_ram_gib() -> float:
    line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if "MemTotal" in x)
    return int(line.split()[1]) / 2**20


@pytest.mark.slow
@pytest.mark.skipif(host_ram_gib() > 400, reason="a host with RAM for the 30B model")
def test_a_model_that_cannot_fit_is_refused_with_what_would(repo):
    result = moe_perf(repo, "model=qwen3-30b-a3b", "mesh=single", "training.device=cpu",
                      "wandb.mode=disabled")  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = [x for x in result.stderr.splitlines() if "cannot run" in x]
    assert "out of memory before it starts: qwen3-30b-a3b" in line
    assert "GiB per rank (weights" in line and "this host's RAM" in line
    assert "Traceback" not in result.stderr
    assert not (repo / "outputs" / "validate-performance").exists()


@pytest.mark.slow
def test_the_overrides_that_would_fit_are_named(repo):
    result = moe_perf(repo, "model=gpt-oss-120b", "model.num_layers=4",
                      "mesh.device_memory_gib=139", "wandb.mode=disabled")  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    line = next(x for x in result.stderr.splitlines() if "cannot run" in x)
    assert "139.0 GiB (mesh.device_memory_gib)" in line
    assert "would fit: mesh.nproc_per_node=2 mesh.ep=2 (on 2 devices), model.num_layers=2" in line
    ok = moe_perf(repo, "model=gpt-oss-120b", "model.num_layers=1", "mesh.device_memory_gib=139",
                  "wandb.mode=disabled", "dry_run=true")  # fmt: skip
    assert ok.returncode == 0, ok.stdout + ok.stderr


def bench_config(model: str, layers: int, global_batch: int, micro_batch: int) -> dict:
    """bench/bench_trainer.py's run on one H200: a preset cut to `layers`, seq 2048, bf16,
    compiled, forced balance, one device."""
    preset = yaml.safe_load((ROOT / "conf" / "model" / f"{model}.yaml").read_text())
    preset.update(num_layers=layers, dense_layers=min(preset["dense_layers"], layers))
    training = {"sequence_length": 2048, "global_batch": global_batch,
                "micro_batch": micro_batch, "device": "cuda"}  # fmt: skip
    return {"model": preset, "dtype": {"name": "bf16"}, "training": training,
            "trainer": {"name": "reference", "compile": True}}  # fmt: skip


# Peaks measured on one GPU (torch 2.11, docs/benchmarks/reference-trainer-step-h100-2026-12.md)
# with the trainer as it is now (bf16 residual stream, the Triton loss): the trainer's
# peak_mem_gib, torch.cuda.max_memory_reserved, with the card's memory. The estimate counts
# tensors (allocated), which the caching allocator's reserve exceeds by a few percent.
GPU_PEAKS_GIB = {
    ("qwen3-30b-a3b", 4, 32, 8): 66.90,  # one H100 80GB, 0f05780 (bench_trainer_ab.sh)
}


def test_fp8_over_master_weights_is_estimated_as_bf16():
    """trainer.fp8_master_weights gives fp8 the bf16 path's weights (bf16 copies over fp32
    masters, a bf16 residual stream) on one rank: the same estimate; without it fp8 keeps
    autocast's fp32 residual stream; under FSDP the switch changes nothing."""
    raw = bench_config("qwen3-30b-a3b", 4, 32, 8)
    fp8 = {**raw, "dtype": {"name": "fp8", "fp8": True},
           "trainer": {**raw["trainer"], "fp8_master_weights": False}}  # fmt: skip
    switched = {**fp8, "trainer": {**raw["trainer"], "fp8_master_weights": True}}

    def estimate(config: dict, **mesh) -> memory.MemoryEstimate:
        return memory.estimate(config_from_dict({**config, "mesh": mesh}), "cuda")

    assert estimate(switched) == estimate(raw)
    assert estimate(fp8).activations > estimate(raw).activations
    fsdp = {"nproc_per_node": 2, "ep": 2}
    assert estimate(switched, **fsdp) == estimate(fp8, **fsdp)


@pytest.mark.parametrize("run", list(GPU_PEAKS_GIB), ids=lambda r: "-".join(map(str, r)))
def test_the_compiled_estimate_matches_the_measured_gpu_peaks(run):
    estimated = memory.estimate(config_from_dict(bench_config(*run)), "cuda")
    assert -0.10 <= estimated.gib() / GPU_PEAKS_GIB[run] - 1 <= 0.02, estimated.breakdown()


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "qwen3.5-35b-a3b", "deepseek-v2-lite",
                                   "gpt-oss-20b", "gpt-oss-120b"])  # fmt: skip
def test_what_ran_on_the_h200_is_not_refused_and_what_ran_out_is(model):
    # every preset at 4 layers, global batch 16, micro-batch 8 ran on one H200 (139 GiB)
    # except gpt-oss-120b, which ran out of memory
    estimated = memory.estimate(config_from_dict(bench_config(model, 4, 16, 8)), "cuda")
    refused = estimated.gib() > 139 * preflight.CLEARLY_OVER
    assert refused == (model == "gpt-oss-120b"), estimated.breakdown()


def saved_for_backward(output, params) -> int:
    """Bytes of the tensors the autograd graph behind `output` keeps for its backward (the
    compiled graphs' saved tensors), parameters themselves left out."""
    own = {p.untyped_storage().data_ptr() for p in params}
    seen, saved, nodes = set(), {}, [output.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for t in getattr(node, "saved_tensors", ()):
            if t is not None and t.untyped_storage().data_ptr() not in own:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        nodes.extend(n for n, _ in node.next_functions)
    return sum(saved.values())


@pytest.mark.slow
def test_the_compiled_estimate_is_what_a_compiled_block_saves():
    # one block of qwen3-30b-a3b's proportions (q/k/v widths, experts, top-8, expert width to
    # hidden, tokens x top-k to the experts' weights), compiled under bf16 autocast as the
    # trainer compiles it (the GPU's partitioner; CPU kernels). Measured: 1.002; gpt-oss's
    # shape 1.001, deepseek-v2-lite's MoE layer 1.000 and its dense layer 0.96.
    import torch

    from moe_perf.trainer.attention import rope_cos_sin, rotary_dims
    from moe_perf.trainer.model import Block

    preset = yaml.safe_load((ROOT / "conf" / "model" / "qwen3-30b-a3b.yaml").read_text())
    preset.update(hidden=256, num_heads=8, num_kv_heads=1, head_dim=64, num_experts=16,
                  expert_ffn=96, num_layers=1)  # fmt: skip
    m = config_from_dict({"model": preset}).model
    block = Block(m, 0, force_balance=True, balance_ep=1)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    block.compile()
    T = 512
    x = torch.randn(1, T, m.hidden, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rope = rope_cos_sin(
            torch.arange(T).expand(1, T), rotary_dims(m.head_dim, m.rope_fraction), m.rope_theta
        )
        y = block(x, rope)
    # the estimate's bf16 weight copies (counted under weights) are saved too
    copies = 2 * sum(p.numel() for p in block.parameters() if p.dim() > 1)
    estimated = memory.compiled_layer_bytes(m, 0, T, 2) + copies
    saved = saved_for_backward(y, list(block.parameters()))
    torch._dynamo.reset()  # no compiled code left for later tests
    assert abs(saved / estimated - 1) <= 0.05


def skewed(*overrides: str):
    """qwen3-30b-a3b cut to 4 layers on ep8, one rank's view, Zipf-skewed routing."""
    return composed("model=qwen3-30b-a3b", "model.num_layers=4", "mesh=ep8",
                    "training.micro_batch=4", "training.device=cuda", "routing=skew",
                    "routing.shape=zipf", *overrides)  # fmt: skip


def estimate_of(cfg) -> memory.MemoryEstimate:
    from omegaconf import OmegaConf

    sections = {k: OmegaConf.to_container(cfg[k], resolve=True)
                for k in preflight.TRAINER_SECTIONS}  # fmt: skip
    return memory.estimate(config_from_dict(sections), "cuda")


@pytest.mark.slow
def test_skew_loads_the_busiest_ep_ranks_activations_only():
    """The experts' side of every MoE layer grows by the busiest EP rank's share of the slots
    (the plan's rank imbalance); weights, the tokens' side and one-rank meshes do not move."""
    balanced = estimate_of(skewed("routing.imbalance=1"))
    previous = balanced
    for r in (1.5, 2.0, 4.0):
        e = estimate_of(skewed(f"routing.imbalance={r}"))
        assert e.activations > previous.activations and e.weights == balanced.weights
        assert (e.gradients, e.logits) == (balanced.gradients, balanced.logits)
        previous = e
    spread = estimate_of(skewed("routing.imbalance=4", "routing.hot_ranks=8"))
    assert balanced.activations < spread.activations < previous.activations
    one_rank = [skewed("mesh=single", "model.num_layers=1", f"routing.imbalance={r}")
                for r in (1, 4)]  # fmt: skip
    assert estimate_of(one_rank[0]).total == estimate_of(one_rank[1]).total


def test_a_skew_that_cannot_fit_is_refused_with_the_imbalance_that_would():
    fits_at_2 = estimate_of(skewed("routing.imbalance=2")).gib()
    cfg = skewed("routing.imbalance=4", f"mesh.device_memory_gib={fits_at_2}")
    with pytest.raises(preflight.PrerequisiteError) as err:
        preflight.check_memory(cfg)
    message = str(err.value)
    tag = "pp1-dp8-cp1-ep8-seq2048-bf16-skew4.0-zipf"
    assert f"out of memory before it starts: qwen3-30b-a3b {tag} needs" in message
    assert "would fit: " in message and ", routing.imbalance=2;" in message
    preflight.check_memory(skewed("routing.imbalance=2", f"mesh.device_memory_gib={fits_at_2}"))


@pytest.mark.slow
def test_another_trainers_memory_is_not_estimated_and_that_is_said(ab_repo):
    gpu_preset = ["model=qwen3-30b-a3b", "mesh=ep8", "mesh.device_memory_gib=80",
                  "wandb.mode=disabled", "dry_run=true"]  # fmt: skip
    reference = moe_perf(ab_repo, *gpu_preset, "-m", "arm=base,feat")
    assert reference.returncode == 2 and "out of memory before it starts" in reference.stderr
    # the README's recipe: trainer.name stays `reference`, the command is the user's trainer
    own = moe_perf(ab_repo, *gpu_preset, "trainer.command=[-m,mytrainer]",
                   "trainer.code_path=mytrainer", "-m", "arm=base,feat")  # fmt: skip
    assert own.returncode == 0, own.stdout + own.stderr
    assert ("memory is not checked before launch: moe_perf estimates only its reference "
            "trainer's memory, and trainer.command=[-m,mytrainer] runs another trainer"
            ) in own.stdout  # fmt: skip
    assert "activation_checkpointing" not in own.stdout + own.stderr


def test_the_readme_says_what_hardware_its_headline_command_needs():
    readme = (ROOT / "README.md").read_text()
    command = readme.split("```\n", 2)[1].splitlines()[0]
    assert command == "python -m moe_perf model=qwen3-30b-a3b mesh=ep8 -m arm=base,feat"
    overrides = [word for word in command.split() if "=" in word and "," not in word]
    cfg, checkpointed = composed(*overrides), composed(*overrides, CHECKPOINTING)
    needs = [memory.estimate(trainer_sections(c), "cuda").gib() for c in (cfg, checkpointed)]
    headline = readme.split(command, 1)[1].split("\n\n", 2)[1]
    assert f"{needs[0]:.1f} GiB per GPU" in headline, headline
    assert f"`{CHECKPOINTING}` ({needs[1]:.1f} GiB)" in headline, headline
    assert needs[0] > 80 > needs[1]  # over an 80 GB H100; under it with checkpointing


CHECKPOINTING = "trainer.activation_checkpointing=full"


def trainer_sections(cfg) -> Config:
    return config_from_dict(
        {k: OmegaConf.to_container(cfg[k], resolve=True) for k in preflight.TRAINER_SECTIONS}
    )
