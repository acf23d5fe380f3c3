"""AllToAllDispatcher against a single-process reference: outputs and gradients, uneven splits.

Each rank holds a different number of tokens routed with a per-rank skew, so the all-to-all
splits are uneven, some (source, destination) pairs carry nothing and some experts get no
token. The reference computes every (token, k) slot with the full expert weights on one rank;
the EP run dispatches, runs only the local expert shard and combines. Dispatch and combine only
move rows, so the test runs in float64 and the two paths differ only by the summation order of
their matmuls: rtol 1e-10, atol 1e-12.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.distributed import run_distributed

from moe_perf.trainer.dispatch import AllToAllDispatcher
from moe_perf.trainer.ep import shard_experts_

RTOL, ATOL = 1e-10, 1e-12
E, K, D, FF = 8, 2, 12, 6


class TinyExperts(torch.nn.Module):
    """GroupedExperts-like: w1, w3 [E, D, F], w2 [E, F, D]; called (x_ND, tokens_per_expert)."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = torch.nn.Parameter(torch.randn(num_experts, D, FF))
        self.w3 = torch.nn.Parameter(torch.randn(num_experts, D, FF))
        self.w2 = torch.nn.Parameter(torch.randn(num_experts, FF, D))

    def forward(self, x_ND, tokens_per_expert):
        out = []
        for e, x in enumerate(torch.split(x_ND, tokens_per_expert.tolist())):
            out.append((F.silu(x @ self.w1[e]) * (x @ self.w3[e])) @ self.w2[e])
        return torch.cat(out)


def reference_slots(experts: TinyExperts, x_TD, topk_idx_TK):
    """y_TKD computed slot by slot with the full weights: no dispatch at all."""
    x = x_TD[:, None, None, :]  # [T, 1, 1, D] against gathered weights [T, K, D, F]
    w1, w3, w2 = experts.w1[topk_idx_TK], experts.w3[topk_idx_TK], experts.w2[topk_idx_TK]
    h = F.silu((x @ w1).squeeze(2)) * (x @ w3).squeeze(2)  # [T, K, F]
    return (h.unsqueeze(2) @ w2).squeeze(2)  # [T, K, D]


def skewed_routing(rank: int, num_tokens: int, gen: torch.Generator):
    """Distinct top-k experts per token, skewed per rank; expert E-1 never chosen."""
    weights = torch.ones(E)
    weights[rank % E] = 8.0  # this rank prefers one expert
    weights[E - 1] = 0.0  # and nobody sends to the last expert
    return torch.stack([torch.multinomial(weights, K, generator=gen) for _ in range(num_tokens)])


def _check_dispatcher(rank: int, world_size: int, ep: int) -> None:
    groups = [dist.new_group(list(range(s, s + ep))) for s in range(0, world_size, ep)]
    group = groups[rank // ep]
    ep_rank = dist.get_rank(group)
    torch.set_default_dtype(torch.float64)

    torch.manual_seed(0)  # identical full weights on every rank
    full = TinyExperts(E)
    gen = torch.Generator().manual_seed(100 + rank)
    num_tokens = 5 + 3 * rank  # uneven token counts across ranks
    x_TD = torch.randn(num_tokens, D, generator=gen)
    topk_idx_TK = skewed_routing(rank, num_tokens, gen)
    grad_TKD = torch.randn(num_tokens, K, D, generator=gen)
    if rank == 0:
        topk_idx_TK[:] = torch.tensor([0, 1])  # rank 0 sends only to EP rank 0 (ep >= 2)

    # Reference: the full weights, every slot on this rank.
    x_ref = x_TD.clone().requires_grad_()
    y_ref = reference_slots(full, x_ref, topk_idx_TK)
    (y_ref * grad_TKD).sum().backward()

    # Expert parallel: local shard, dispatch, compute, combine.
    local = TinyExperts(E)
    local.load_state_dict(full.state_dict())
    shard_experts_(local, ep_rank, ep)
    assert local.w1.shape[0] == E // ep
    dispatcher = AllToAllDispatcher(group, E)
    x_ep = x_TD.clone().requires_grad_()
    x_ND, tokens_per_expert, state = dispatcher.dispatch(x_ep, topk_idx_TK)
    assert tokens_per_expert.shape == (E // ep,)
    assert int(tokens_per_expert.sum()) == x_ND.shape[0]
    y_ep = dispatcher.combine(local(x_ND, tokens_per_expert), state)
    (y_ep * grad_TKD).sum().backward()

    torch.testing.assert_close(y_ep, y_ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(x_ep.grad, x_ref.grad, rtol=RTOL, atol=ATOL)

    # The local expert shard's gradient is the sum over the EP group's tokens.
    lo, hi = dispatcher.local_expert_range
    for name in ("w1", "w3", "w2"):
        g_full = getattr(full, name).grad.clone()
        dist.all_reduce(g_full, group=group)
        torch.testing.assert_close(getattr(local, name).grad, g_full[lo:hi], rtol=RTOL, atol=ATOL)

    # Counts: each local expert receives exactly what the group routed to it.
    counts = torch.bincount(topk_idx_TK.reshape(-1), minlength=E)
    dist.all_reduce(counts, group=group)
    assert tokens_per_expert.tolist() == counts[lo:hi].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("world_size,ep", [(4, 2), (4, 4)])
def test_all_to_all_dispatcher_matches_reference(world_size, ep):
    run_distributed(_check_dispatcher, world_size, ep)
