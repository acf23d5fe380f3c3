"""Routing: the router's scores and top-k, and the ids a token is sent to when the router's
choice is replaced (routing=balanced: forced balance; routing=skew: a stated imbalance).

One class per forced routing behind one interface, `expert_ids(token_offset, num_tokens,
device) -> topk_idx_TK`, installed in every MoE layer (moe.set_expert_assignment); routing=real
installs none and the router's own top-k is dispatched.
Shapes: the trainer's legend (moe_perf/trainer/__init__.py).
"""

from __future__ import annotations

import torch
from torch import nn

from moe_perf.common.config import Config, skew_plan_of
from moe_perf.common.mesh import MeshDims
from moe_perf.common.routing import SkewPlan


def forced_expert_ids(
    global_token_offset: int | torch.Tensor,
    num_tokens: int,
    top_k: int,
    num_experts: int,
    ep: int,
    device=None,
) -> torch.Tensor:
    """Round-robin expert ids over the GLOBAL slot index s = g*K + k, g = offset + i.

    expert(s) = (s % ep) * (E/ep) + (s // ep) % (E/ep) depends only on s mod E and is a
    bijection of residues mod E, so every expert gets the same count over any E consecutive
    slots: exact balance per step when the step's slots are a multiple of E, and within one
    of each other on any contiguous range of tokens otherwise. Counting from the global index
    rather than from 0 on every rank matters: with per-rank counting and T*K not a multiple of
    E, the low experts get extra slots on every rank. Consecutive slots of one token go to
    consecutive EP ranks, so the K slots of a token never pile onto one rank when K <= ep
    (which would understate the all-to-all traffic).
    """
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep={ep}")
    per_rank = num_experts // ep
    g_T1 = torch.arange(num_tokens, device=device, dtype=torch.long).unsqueeze(1)
    s_TK = (global_token_offset + g_T1) * top_k + torch.arange(top_k, device=device)
    return (s_TK % ep) * per_rank + (s_TK // ep) % per_rank


class BalancedSlots:
    """routing=balanced: `forced_expert_ids`, exact balance per step."""

    def __init__(self, num_experts: int, top_k: int, ep: int):
        if num_experts % ep:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep={ep}")
        self.num_experts, self.top_k, self.ep = num_experts, top_k, ep

    def expert_ids(self, token_offset, num_tokens: int, device=None) -> torch.Tensor:
        return forced_expert_ids(
            token_offset, num_tokens, self.top_k, self.num_experts, self.ep, device
        )


class SkewedSlots:
    """routing=skew: token g gets row g mod T of the plan's T x K table (common/routing.py),
    found by a sorted search of the slot's position k*T + row among the experts' slot ends, so
    only E ends live on the device. A micro-batch of T tokens on a rank is one whole table:
    exactly the planned counts per expert, per rank, per micro-batch and per step."""

    def __init__(self, plan: SkewPlan, device=None):
        self.plan = plan
        self.slot_ends_E = torch.tensor(plan.slot_ends(), dtype=torch.long, device=device)
        self.top_k = plan.top_k

    def expert_ids(self, token_offset, num_tokens: int, device=None) -> torch.Tensor:
        T = self.plan.tokens
        row_T = (token_offset + torch.arange(num_tokens, device=device)) % T
        position_TK = row_T.unsqueeze(1) + T * torch.arange(self.top_k, device=device)
        return torch.searchsorted(self.slot_ends_E, position_TK, right=True)


ASSIGNMENTS = {
    "balanced": lambda cfg, dims, device: BalancedSlots(
        cfg.model.num_experts, cfg.model.top_k, dims.ep
    ),
    "skew": lambda cfg, dims, device: SkewedSlots(
        skew_plan_of(cfg.routing, cfg.model, dims, cfg.training), device
    ),
    "real": lambda cfg, dims, device: None,  # the router's own top-k
}


def expert_assignment(cfg: Config, dims: MeshDims, device) -> BalancedSlots | SkewedSlots | None:
    """What `routing.mode` installs in every MoE layer (moe.set_expert_assignment)."""
    return ASSIGNMENTS[cfg.routing.mode](cfg, dims, device)


class Router(nn.Module):
    """Scores every expert for every token and picks the top-k.

    Returns scores_TE (softmax probabilities, or sigmoid affinities), the real top-k ids and the
    gating weights at those ids (renormalised over the K when norm_topk_prob).
    """

    def __init__(
        self, dim: int, num_experts: int, top_k: int, kind: str, norm_topk_prob: bool, bias: bool
    ):
        super().__init__()
        if kind not in ("softmax", "sigmoid"):
            raise ValueError(f"model.router={kind!r}: expected softmax or sigmoid")
        self.gate = nn.Linear(dim, num_experts, bias=bias)
        self.kind, self.top_k, self.norm_topk_prob = kind, top_k, norm_topk_prob

    def forward(self, x_TD: torch.Tensor):
        # Routing decisions in fp32: bf16 logits tie and flip top-k between runs.
        logits_TE = self.gate(x_TD).float()
        scores_TE = logits_TE.softmax(-1) if self.kind == "softmax" else logits_TE.sigmoid()
        topk_scores_TK, topk_idx_TK = scores_TE.topk(self.top_k, dim=-1)
        return scores_TE, topk_idx_TK, topk_scores_TK

    def gating(self, scores_TE: torch.Tensor, topk_idx_TK: torch.Tensor) -> torch.Tensor:
        """Weights of the chosen experts, renormalised over K if the model does."""
        w_TK = scores_TE.gather(1, topk_idx_TK)
        if self.norm_topk_prob:
            w_TK = w_TK / (w_TK.sum(-1, keepdim=True) + 1e-20)
        return w_TK
