"""The single-device model: every shipped model config builds (shrunk) and trains; experts,
dispatch, balance losses and the FLOP formula."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from moe_perf.common.config import ModelConfig
from moe_perf.trainer import flops
from moe_perf.trainer.balance import global_batch_balance_loss, sequence_balance_loss
from moe_perf.trainer.dispatch import LocalDispatcher
from moe_perf.trainer.experts import GroupedExperts, _grouped_mm_ok
from moe_perf.trainer.layers import swiglu
from moe_perf.trainer.model import build_model, cross_entropy
from moe_perf.trainer.moe import MoE

MODEL_DIR = Path(__file__).resolve().parents[1] / "conf" / "model"
MODELS = sorted(p.stem for p in MODEL_DIR.glob("*.yaml"))


def model_config(name: str, **small) -> ModelConfig:
    raw = yaml.safe_load((MODEL_DIR / f"{name}.yaml").read_text())
    raw.pop("defaults", None)  # a preset's Hydra defaults list is not a model field
    return dataclasses.replace(ModelConfig(**raw), **small)


def shrunk(name: str) -> ModelConfig:
    """The model's architecture (heads ratio, partial RoPE, v dim, shared/dense, router) at toy
    width: hidden 64, 3 layers, head dims scaled down, 8 experts."""
    m = model_config(name)
    scale = 16 / m.head_dim
    return dataclasses.replace(
        m,
        vocab_size=256,
        hidden=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=4 // (m.num_heads // m.num_kv_heads) or 1,
        head_dim=16,
        v_head_dim=int(m.v_head_dim * scale) if m.v_head_dim else None,
        num_experts=8,
        top_k=min(m.top_k, 4),
        expert_ffn=32,
        shared_expert_ffn=32 if m.num_shared_experts else 0,
        dense_layers=min(m.dense_layers, 1),
        dense_ffn=48 if m.dense_layers else 0,
    )


@pytest.mark.parametrize("name", MODELS)
def test_every_model_config_builds_runs_forward_and_backward(name):
    m = shrunk(name)
    model = build_model(m, seed=0, force_balance=True)
    tokens = torch.randint(0, m.vocab_size, (2, 17))
    logits = model(tokens[:, :-1])
    assert logits.shape == (2, 16, m.vocab_size)
    loss = cross_entropy(logits, tokens[:, 1:])
    assert torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []


def test_dense_and_shared_experts_follow_the_config():
    m = shrunk("deepseek-v2-lite")
    model = build_model(m, seed=0, force_balance=False)
    assert not model.layers["0"].moe_enabled and model.layers["1"].moe_enabled
    assert model.layers["1"].ffn.shared.w1.out_features == m.num_shared_experts * 32
    attn = model.layers["1"].attention
    assert attn.wv.out_features == m.num_kv_heads * m.v_head_dim
    cos, sin = model.rope_tables(torch.arange(5).unsqueeze(0))
    assert cos.shape == sin.shape == (1, 1, 5, 3)  # 1/3 of 16 rotated, rounded to even: 6 dims


def test_same_seed_same_model_and_positions_reach_rope():
    m = shrunk("qwen3-30b-a3b")
    a, b = build_model(m, seed=3, force_balance=False), build_model(m, seed=3, force_balance=False)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    tokens = torch.randint(0, m.vocab_size, (1, 12))
    pos = torch.arange(12).unsqueeze(0)
    with torch.no_grad():
        base = a(tokens)
        torch.testing.assert_close(a(tokens, pos), base)
        # RoPE is relative: shifting every position leaves attention (hence logits) unchanged,
        # while a permutation of positions does not.
        torch.testing.assert_close(a(tokens, pos + 100), base, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(a(tokens, pos.flip(1)), base, atol=1e-3)


@pytest.mark.parametrize(
    "dtype,clamp", [(torch.float32, 0.0), (torch.float32, 7.0), (torch.bfloat16, 0.0)]
)
@pytest.mark.parametrize("backend", ["grouped_mm", "loop", "bmm"])
def test_grouped_experts_equal_a_per_expert_reference(dtype, clamp, backend):
    """`bmm`: auto with every expert's count equal (the round-robin dispatch's promise)."""
    torch.manual_seed(0)
    L, D, F = 4, 32, 16
    experts = GroupedExperts(L, D, F, swiglu_clamp=clamp).to(dtype)
    experts.init_weights(0.5, 0.5)
    experts.backend = "auto" if backend == "bmm" else backend
    counts = torch.tensor([3, 3, 3, 3] if backend == "bmm" else [3, 0, 5, 2])
    x_ND = torch.randn(int(counts.sum()), D, dtype=dtype, requires_grad=True)
    y_ND = experts(x_ND, counts, equal_counts=backend == "bmm")
    g = torch.randn_like(y_ND)
    (y_ND * g).sum().backward()
    got_x, got_w13 = x_ND.grad.clone(), experts.w13.grad.clone()

    x_ND.grad = None
    experts.zero_grad()
    ref, start = [], 0
    w1, w3 = experts.w13[..., :F], experts.w13[..., F:]  # gate and up projections
    for e, n in enumerate(counts.tolist()):
        x = x_ND[start : start + n]
        ref.append(swiglu(x @ w1[e], x @ w3[e], clamp) @ experts.w2[e])
        start += n
    ref = torch.cat(ref)
    (ref * g).sum().backward()
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y_ND, ref, **tol)
    torch.testing.assert_close(got_x, x_ND.grad, **tol)
    torch.testing.assert_close(got_w13, experts.w13.grad, **tol)


def test_grouped_experts_compile_in_fp32():
    """Eager fp32 on the CPU runs torch._grouped_mm, whose meta kernel (what dynamo traces
    with) takes bf16 only: compiled, fp32 goes another way, to the same result."""
    torch.manual_seed(0)
    experts = GroupedExperts(4, 32, 16)
    experts.init_weights(0.5, 0.5)
    counts = torch.tensor([4, 0, 8, 4])  # 16 rows: strides _grouped_mm takes
    x_ND = torch.randn(int(counts.sum()), 32)
    assert _grouped_mm_ok(x_ND, experts.w13, experts.w2)  # eager: the grouped path
    eager = experts(x_ND, counts)
    torch._dynamo.reset()
    compiled = torch.compile(experts, backend="eager")(x_ND, counts)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_local_dispatch_sorts_by_expert_and_combine_restores_order():
    torch.manual_seed(0)
    T, K, E, D = 9, 3, 5, 4
    x_TD = torch.randn(T, D)
    idx_TK = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    disp = LocalDispatcher(E)
    x_ND, tokens_per_expert, state = disp.dispatch(x_TD, idx_TK)
    assert tokens_per_expert.tolist() == torch.bincount(idx_TK.reshape(-1), minlength=E).tolist()
    expert_of_row = torch.repeat_interleave(torch.arange(E), tokens_per_expert)
    # Each row is a copy of a token routed to the expert its position says.
    for row, e in zip(x_ND, expert_of_row, strict=True):
        t = int((x_TD == row).all(1).nonzero()[0])
        assert e in idx_TK[t]
    y_TKD = disp.combine(x_ND * 2, state)
    torch.testing.assert_close(y_TKD, 2 * x_TD.unsqueeze(1).expand(T, K, D))


def test_balance_losses_match_their_definitions():
    torch.manual_seed(0)
    B, S, E, K = 3, 8, 6, 2
    scores_TE = torch.randn(B * S, E).softmax(-1)
    idx_TK = scores_TE.topk(K, dim=-1).indices
    # global-batch: E * sum_e f_e P_e, f_e = fraction of slots at e.
    f = torch.bincount(idx_TK.reshape(-1), minlength=E).float() / (B * S * K)
    expected = E * (f * scores_TE.mean(0)).sum()
    torch.testing.assert_close(global_batch_balance_loss(scores_TE, idx_TK, None), expected)
    # sequence: per sequence, f_e = E/(K*S) * count, P_e = mean score; mean over sequences.
    per_seq = []
    for b in range(B):
        sl = slice(b * S, (b + 1) * S)
        c = torch.bincount(idx_TK[sl].reshape(-1), minlength=E).float()
        per_seq.append((c * E / (K * S) * scores_TE[sl].mean(0)).sum())
    torch.testing.assert_close(
        sequence_balance_loss(scores_TE, idx_TK, B, None), torch.stack(per_seq).mean()
    )
    # Perfect balance with uniform scores gives 1 for both.
    uniform = torch.full((B * S, E), 1.0 / E)
    rr = torch.arange(B * S * K).view(B * S, K) % E
    assert global_batch_balance_loss(uniform, rr[: E // K * 4], None).item() == pytest.approx(1)


@pytest.mark.parametrize("kind", ["global-batch", "sequence"])
def test_balance_loss_gradient_reaches_the_router_with_the_step_scale(kind):
    """The loss attached to the MoE output equals adding coeff * loss * scale to the objective."""
    torch.manual_seed(0)
    moe = MoE(16, 8, 2, 16, load_balance=kind, load_balance_coeff=0.1, force_balance=True)
    moe.init_weights(0.5, 0.5)
    moe.aux_loss_grad_scale = 0.25
    x = torch.randn(2, 6, 16)
    moe(x).sum().backward()
    got = moe.router.gate.weight.grad.clone()

    moe.zero_grad()
    moe.aux_loss_grad_scale = 0.0
    out = moe(x)
    scores_TE, real_TK, _, _ = moe.route(x.reshape(12, 16))
    aux = moe.balance_loss(scores_TE, real_TK, 2) * 0.1
    (out.sum() + 0.25 * aux).backward()
    torch.testing.assert_close(got, moe.router.gate.weight.grad)
    assert moe.last_aux_loss is not None and moe.last_aux_loss > 0


def test_flops_formula_on_qwen3_30b_a3b():
    m = model_config("qwen3-30b-a3b")
    n = flops.matmul_params_per_token(m)
    # "A3B": ~3.3B active parameters, embedding excluded from matmuls but head included.
    assert 2.9e9 < n < 3.4e9
    attn = flops.attention_flops_per_token(m, 2048)
    assert attn == 3 * 48 * 32 * (128 + 128) * 2048  # = 6*L*H*Dh*S: causal half of 12*L*H*Dh*S
    assert flops.flops_per_token(m, 2048) == 6 * n + attn
    tf, mfu = flops.tflops_and_mfu(m, 2048, 10_000, 1, "NVIDIA H200", "bf16")
    assert mfu == pytest.approx(tf * 1e12 / 989.5e12)
    assert flops.tflops_and_mfu(m, 2048, 10_000, 1, None, "bf16")[1] is None


@pytest.mark.parametrize("name", MODELS)
def test_the_per_layer_flops_add_up_to_the_mfu_formula(name):
    """pp.py balances stages by the per-layer terms of the same formula: three times the
    forward FLOPs of every layer and the head is the training FLOPs per token."""
    m = model_config(name)
    forward = sum(flops.layer_forward_flops(m, i, 2048) for i in range(m.num_layers))
    forward += flops.head_forward_flops(m)
    assert 3 * forward == flops.flops_per_token(m, 2048)


@pytest.mark.parametrize(
    "dispatch,backend,expected",
    [("structured", "auto", True), ("sort", "auto", False), ("structured", "grouped_mm", False)],
)
def test_forced_balance_runs_the_experts_as_batched_matmuls(dispatch, backend, expected):
    """Under forced balance on one EP rank every expert gets T*K/E rows: the round-robin
    dispatch tells the experts so, and they run moe_perf::expert_bmm (forward and backward),
    unless trainer.expert_backend=grouped_mm asks for the grouped kernel."""
    torch.manual_seed(0)
    moe = MoE(32, 8, 2, 16, force_balance=True)
    moe.init_weights(0.1, 0.1)
    moe.forced_dispatch = dispatch
    moe.experts.backend = backend
    x = torch.randn(2, 8, 32, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        moe(x).sum().backward()
    names = {e.key for e in prof.key_averages()}
    assert ("moe_perf::expert_bmm" in names) is expected
    assert ("moe_perf::expert_bmm_backward" in names) is expected
    assert x.grad is not None and moe.experts.w2.grad is not None
