"""Forced balance: exact per-expert counts per step over the GLOBAL slot index."""

from __future__ import annotations

import itertools

import pytest
import torch

from moe_perf.common.mesh import MeshDims
from moe_perf.trainer.moe import MoE
from moe_perf.trainer.routing import forced_expert_ids

# (experts, top_k, tokens per rank per micro-batch, ep, dp*cp ranks, micro-batches)
CASES = [
    (8, 2, 16, 1, 1, 1),
    (8, 2, 5, 2, 2, 4),  # a rank's 5*2 = 10 slots: not a multiple of 8
    (128, 8, 24, 8, 8, 2),  # 24*8 = 192 slots per rank: not a multiple of 128
    (64, 6, 7, 4, 4, 8),  # deepseek-like K=6; 42 slots per rank
    (32, 4, 3, 2, 4, 8),  # edp=2 x ep=2
    (16, 3, 11, 4, 4, 16),  # K=3 < ep=4
]


def step_ids(E, K, T, ep, dp_cp, n_micro):
    """{(micro-batch, rank): topk_idx_TK} with the train loop's offsets (MeshDims.token_offset,
    here with sequences of T tokens and one sequence per micro-batch)."""
    dims = MeshDims(world=dp_cp)
    return {
        (m, r): forced_expert_ids(dims.token_offset(m, r, 1, T), T, K, E, ep)
        for m, r in itertools.product(range(n_micro), range(dp_cp))
    }


@pytest.mark.parametrize("E,K,T,ep,dp_cp,n_micro", CASES)
def test_every_expert_gets_the_same_count_per_step(E, K, T, ep, dp_cp, n_micro):
    ids = step_ids(E, K, T, ep, dp_cp, n_micro)
    counts_E = torch.bincount(torch.cat([i.reshape(-1) for i in ids.values()]), minlength=E)
    total = T * K * dp_cp * n_micro
    if total % E == 0:
        assert counts_E.tolist() == [total // E] * E
    else:
        assert counts_E.max() - counts_E.min() <= 1
    # Hence every EP rank receives exactly the same number of slots per step.
    per_ep_rank = counts_E.view(ep, E // ep).sum(1)
    if total % E == 0:
        assert per_ep_rank.unique().numel() == 1


@pytest.mark.parametrize("E,K,T,ep,dp_cp,n_micro", CASES)
def test_each_ep_group_is_balanced_within_one_per_micro_batch(E, K, T, ep, dp_cp, n_micro):
    """Within one micro-batch, an EP group (ep consecutive dp*cp ranks) holds a contiguous run
    of global tokens, so its experts' counts differ by at most one."""
    ids = step_ids(E, K, T, ep, dp_cp, n_micro)
    for m in range(n_micro):
        for g in range(dp_cp // ep):
            group = torch.cat([ids[(m, r)].reshape(-1) for r in range(g * ep, (g + 1) * ep)])
            counts = torch.bincount(group, minlength=E)
            assert counts.max() - counts.min() <= 1


def test_a_rank_alone_is_not_skewed_toward_low_experts():
    """Counting from 0 on every rank would give the low experts extra slots on every rank."""
    E, K, T, dp, n_micro = 8, 2, 5, 4, 4
    ids = step_ids(E, K, T, 1, dp, n_micro)
    counts = torch.bincount(torch.cat([i.reshape(-1) for i in ids.values()]), minlength=E)
    assert counts.tolist() == [T * K * dp * n_micro // E] * E
    naive = torch.bincount(
        torch.cat([forced_expert_ids(0, T, K, E, 1).reshape(-1)] * dp * n_micro), minlength=E
    )
    assert naive.max() > naive.min()  # what the global index avoids


@pytest.mark.parametrize("K,ep", [(2, 2), (4, 8), (8, 8), (6, 4)])
def test_slots_of_one_token_spread_over_ep_ranks(K, ep):
    """A token's K experts land on min(K, ep) different EP ranks, evenly."""
    E = 8 * ep
    idx_TK = forced_expert_ids(123, 50, K, E, ep)
    ranks_TK = idx_TK // (E // ep)
    for row in ranks_TK:
        counts = torch.bincount(row, minlength=ep)
        assert counts.max() - counts.min() <= 1
    assert (idx_TK.sort(1).values.diff(dim=1) > 0).all()  # K distinct experts per token


def test_forced_ids_need_experts_divisible_by_ep():
    with pytest.raises(ValueError, match="divisible"):
        forced_expert_ids(0, 4, 2, 6, 4)


@pytest.mark.parametrize("router,norm", [("softmax", True), ("softmax", False), ("sigmoid", True)])
def test_moe_dispatches_forced_ids_with_real_scores(router, norm):
    torch.manual_seed(0)
    E, K, D = 8, 2, 16
    moe = MoE(D, E, K, 16, router=router, norm_topk_prob=norm, force_balance=True, balance_ep=2)
    moe.init_weights(0.02, 0.02)
    moe.global_token_offset = 40
    x_TD = torch.randn(12, D)
    scores_TE, real_TK, idx_TK, w_TK = moe.route(x_TD)
    assert torch.equal(idx_TK, forced_expert_ids(40, 12, K, E, 2))
    expected = scores_TE.gather(1, idx_TK)
    if norm:
        expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(w_TK, expected)
    # The real router still ran: its own top-k is what the balance loss sees.
    assert torch.equal(real_TK, scores_TE.topk(K, dim=-1).indices)

    _, tokens_per_expert_E, _ = moe.dispatcher.dispatch(x_TD, idx_TK)
    assert tokens_per_expert_E.tolist() == [12 * K // E] * E


def test_without_benchmark_the_router_decides():
    torch.manual_seed(0)
    moe = MoE(16, 8, 2, 16, force_balance=False)
    moe.init_weights(0.02, 0.02)
    x = torch.randn(10, 16)
    scores, real, idx, _ = moe.route(x)
    assert torch.equal(idx, real)


@pytest.mark.parametrize("T,K,E", [(16, 2, 8), (12, 8, 32), (6, 4, 8), (64, 8, 128), (12, 6, 8)])
def test_round_robin_dispatch_is_the_sorted_dispatch_without_the_sort(T, K, E):
    """Forced balance's aligned slots: the strided dispatch gives the sort's rows, counts and
    combine, and the same gradients."""
    from moe_perf.trainer.dispatch import LocalDispatcher

    torch.manual_seed(0)
    d = LocalDispatcher(E)
    idx_TK = forced_expert_ids(T * E, T, K, E, 1)  # an aligned offset: T*E*K mod E == 0
    x1 = torch.randn(T, 5, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    ref_ND, ref_counts, ref_state = d.dispatch(x1, idx_TK)
    rr_ND, rr_counts, rr_state = d.dispatch_round_robin(x2, K)
    assert torch.equal(rr_ND, ref_ND) and torch.equal(rr_counts, ref_counts)
    w = torch.randn(T * K, 5)  # a per-row transform, so that combine's order matters
    ref, rr = d.combine(ref_ND * w, ref_state), d.combine(rr_ND * w, rr_state)
    assert torch.equal(rr, ref)
    g = torch.randn_like(ref)
    (ref * g).sum().backward()
    (rr * g).sum().backward()
    torch.testing.assert_close(x2.grad, x1.grad, rtol=0, atol=1e-6)


def test_the_moe_takes_the_round_robin_dispatch_only_where_it_holds():
    torch.manual_seed(0)
    E, K, D, T = 8, 2, 16, 12
    moe = MoE(D, E, K, 16, force_balance=True, balance_ep=1)
    moe.init_weights(0.02, 0.02)
    x = torch.randn(1, T, D)
    moe.global_token_offset = 4 * T  # (4T * K) mod E == 0
    assert moe.round_robin(T) and not moe.round_robin(T + 1)  # T*K no multiple of E
    outs = {}
    for mode in ("structured", "sort"):
        moe.forced_dispatch = mode
        xi = x.clone().requires_grad_()
        y = moe(xi)
        y.square().sum().backward()
        outs[mode] = (y.detach(), xi.grad, moe.experts.w13.grad.clone())
        moe.zero_grad(set_to_none=True)
    assert not moe.round_robin(T)  # sort
    for a, b in zip(outs["structured"], outs["sort"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    moe.forced_dispatch = "structured"
    moe.global_token_offset = 3  # 3*K = 6: not a multiple of E, the slots start mid-cycle
    assert not moe.round_robin(T)
    assert not MoE(D, E, K, 16, force_balance=False).round_robin(T)
    assert not MoE(D, E, K, 16, force_balance=True, balance_ep=2).round_robin(T)
