"""The mixture-of-experts block: router, forced routing, dispatch, experts, shared experts and
the balance loss, put together; and the setters the train loop and parallelize.py use.

Single-device code. Expert parallelism swaps `MoE.dispatcher` (dispatch.py) and slices the
`GroupedExperts` weights on dim 0; the balance loss's cross-rank sum is the injected
`MoE.balance_reduction` (balance.py). parallelize.py does both.
Shapes: the trainer's legend (moe_perf/trainer/__init__.py).
"""

from __future__ import annotations

import torch
from torch import nn

from moe_perf.trainer.balance import (
    Reduction,
    attach_aux_loss,
    global_batch_balance_loss,
    sequence_balance_loss,
)
from moe_perf.trainer.dispatch import LocalDispatcher
from moe_perf.trainer.experts import GroupedExperts, expert_scope
from moe_perf.trainer.layers import FeedForward
from moe_perf.trainer.routing import BalancedSlots, Router

LOAD_BALANCE_KINDS = ("global-batch", "sequence")


class MoE(nn.Module):
    """Routed SwiGLU experts (+ shared experts), forced routing, and the balance loss.

    Attributes set from outside (not parameters):
      assignment           the ids tokens are sent to when the router's choice is replaced
                           (routing.BalancedSlots, routing.SkewedSlots; None: the router's
                           own top-k); `force_balance` makes a BalancedSlots,
                           `set_expert_assignment(model, a)` sets all layers.
      global_token_offset  global index of this rank's first token of the current micro-batch
                           (forced routing), kept in the `token_offset` buffer;
                           `set_token_offset(model, offset)` sets all layers.
      balance_reduction    the sum of the balance-loss statistics over the ranks they span:
                           dp x cp for the global-batch loss, cp for the sequence loss (None:
                           this rank's tokens are all there is).
      aux_loss_grad_scale  gradient the balance loss gets per backward (1/micro-batches).
      last_aux_loss        detached balance loss of the last forward (for logging).
      last_tokens_per_expert  slots this rank's experts processed in the last forward
                           (tokens_per_expert_L, as the dispatcher counted them, or an int when
                           every expert got that many; read by `tokens_processed` after each
                           forward, outside the step's math).
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        expert_ffn: int,
        *,
        router: str = "softmax",
        norm_topk_prob: bool = True,
        router_bias: bool = False,
        num_shared_experts: int = 0,
        shared_expert_ffn: int = 0,
        shared_expert_gate: bool = False,
        swiglu_clamp: float = 0.0,
        load_balance: str = "global-batch",
        load_balance_coeff: float = 0.0,
        force_balance: bool = False,
        balance_ep: int = 1,
        layer_id: int = 0,
    ):
        super().__init__()
        if load_balance not in LOAD_BALANCE_KINDS:
            raise ValueError(f"model.load_balance={load_balance!r}: global-batch or sequence")
        self.num_experts, self.top_k = num_experts, top_k
        self.router = Router(dim, num_experts, top_k, router, norm_topk_prob, router_bias)
        self.experts = GroupedExperts(num_experts, dim, expert_ffn, swiglu_clamp)
        self.dispatcher = LocalDispatcher(num_experts)
        shared_ffn = num_shared_experts * shared_expert_ffn
        self.shared = FeedForward(dim, shared_ffn, swiglu_clamp) if shared_ffn else None
        self.shared_gate = (
            nn.Linear(dim, 1, bias=False) if shared_ffn and shared_expert_gate else None
        )
        self.load_balance, self.load_balance_coeff = load_balance, load_balance_coeff
        self.layer_id = layer_id  # the model's global layer index (the imbalance record's row)
        self.assignment = BalancedSlots(num_experts, top_k, balance_ep) if force_balance else None
        # A 0-d tensor, not a Python int: torch.compile would specialize on (and recompile
        # for) every new int offset; a tensor value is not guarded.
        self.register_buffer("token_offset", torch.zeros((), dtype=torch.long), persistent=False)
        # Whether offset*K is a multiple of E (a host bool the offset setter keeps; compiled
        # code guards on it, two variants at most): forced balance's slots then go round-robin
        # from expert 0 and the dispatch is a fixed strided layout (`round_robin`).
        self.slots_aligned = True
        self.forced_dispatch = "structured"  # or "sort": the general path (trainer knob)
        self.balance_reduction: Reduction | None = None
        self.aux_loss_grad_scale = 1.0
        self.last_aux_loss: torch.Tensor | None = None
        self.last_tokens_per_expert: torch.Tensor | None = None

    @property
    def force_balance(self) -> bool:
        return isinstance(self.assignment, BalancedSlots)

    @property
    def global_token_offset(self) -> int:
        return int(self.token_offset)  # a host sync: for tests and logs only

    @global_token_offset.setter
    def global_token_offset(self, offset: int) -> None:
        self.token_offset.fill_(offset)  # in place: no sync, and compiled code sees the value
        self.slots_aligned = (offset * self.top_k) % self.num_experts == 0

    def round_robin(self, num_tokens: int) -> bool:
        """Whether this micro-batch's slots go round-robin, slot s = t*K + k to expert s mod E,
        so the dispatcher can skip the sort (LocalDispatcher.dispatch_round_robin): forced
        balance on one EP rank (routing.forced_expert_ids is then (offset*K + s) mod E), the
        offset aligned, and T*K a multiple of E."""
        return (
            self.force_balance
            and self.assignment.ep == 1
            and self.forced_dispatch == "structured"
            and self.slots_aligned
            and (num_tokens * self.top_k) % self.num_experts == 0
            and isinstance(self.dispatcher, LocalDispatcher)
        )

    def init_weights(self, std: float, out_std: float, generator=None) -> None:
        """Weights from `generator` (None: the global RNG); also resets the token offset, a
        non-persistent buffer that `to_empty` leaves uninitialised."""
        nn.init.trunc_normal_(self.router.gate.weight, std=std, generator=generator)
        if self.router.gate.bias is not None:
            nn.init.zeros_(self.router.gate.bias)
        self.experts.init_weights(std, out_std, generator)
        if self.shared is not None:
            self.shared.init_weights(std, out_std, generator)
        if self.shared_gate is not None:
            nn.init.trunc_normal_(self.shared_gate.weight, std=std, generator=generator)
        self.token_offset.zero_()

    def route(self, x_TD: torch.Tensor):
        """(scores_TE, real topk_idx_TK, dispatched topk_idx_TK, gating weights_TK)."""
        scores_TE, real_idx_TK, _ = self.router(x_TD)
        idx_TK = real_idx_TK
        if self.assignment is not None:
            idx_TK = self.assignment.expert_ids(self.token_offset, x_TD.shape[0], x_TD.device)
        return scores_TE, real_idx_TK, idx_TK, self.router.gating(scores_TE, idx_TK)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        scores_TE, real_idx_TK, idx_TK, weights_TK = self.route(x_TD)

        equal_counts = self.round_robin(x_TD.shape[0])
        if equal_counts:
            x_ND, tokens_per_expert_L, state = self.dispatcher.dispatch_round_robin(
                x_TD, self.top_k
            )
        else:
            x_ND, tokens_per_expert_L, state = self.dispatcher.dispatch(x_TD, idx_TK)
        # A reference, no work in the step. The round-robin dispatch's counts are one known
        # number, kept as an int: its torch.full is otherwise dead code that compile drops.
        self.last_tokens_per_expert = (
            x_TD.shape[0] * self.top_k // self.num_experts if equal_counts else tokens_per_expert_L
        )
        with expert_scope():
            y_ND = self.experts(x_ND, tokens_per_expert_L, equal_counts)
        y_TKD = self.dispatcher.combine(y_ND, state)
        # sum_k w_TK * y_TKD: elementwise and a reduction (fused under compile); a bmm of
        # T [1,K] @ [K,D] products ran at a few TFLOP/s. CUDA's autocast sums in fp32 and
        # returns fp32: cast back, or the residual stream turns fp32 after the first MoE layer
        # (and compile traces every later block a second time, for its fp32 input).
        out_TD = (y_TKD * weights_TK.to(y_TKD.dtype).unsqueeze(-1)).sum(1).to(y_TKD.dtype)

        if self.shared is not None:
            shared_TD = self.shared(x_TD)
            if self.shared_gate is not None:
                shared_TD = torch.sigmoid(self.shared_gate(x_TD)) * shared_TD
            out_TD = out_TD + shared_TD
        out_BSD = out_TD.view(B, S, D)

        if self.load_balance_coeff > 0 and self.training:
            # The loss is computed on the router's own choice (real_idx), which is what it
            # trains; under forced routing the dispatched ids are fixed by construction.
            aux = self.balance_loss(scores_TE, real_idx_TK, B) * self.load_balance_coeff
            self.last_aux_loss = aux.detach()
            if torch.is_grad_enabled():
                out_BSD = attach_aux_loss(out_BSD, aux, self.aux_loss_grad_scale)
        return out_BSD

    def balance_loss(self, scores_TE, topk_idx_TK, batch: int) -> torch.Tensor:
        if self.load_balance == "global-batch":
            return global_batch_balance_loss(scores_TE, topk_idx_TK, self.balance_reduction)
        return sequence_balance_loss(scores_TE, topk_idx_TK, batch, self.balance_reduction)


# --------------------------------------------------------------------------------------------
# Setters over every MoE layer of a model (or a pipeline stage of one)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_token_offset(model: nn.Module, offset: int) -> None:
    """Global index of this rank's first token in the micro-batch about to run (forced balance,
    MeshDims.token_offset)."""
    for m in moe_layers(model):
        m.global_token_offset = offset


def set_expert_assignment(model: nn.Module, assignment) -> None:
    """The ids every MoE layer sends tokens to (routing.BalancedSlots or SkewedSlots, one
    object shared by the layers), or None for the router's own top-k (routing=real)."""
    for m in moe_layers(model):
        m.assignment = assignment


def tokens_processed(model: nn.Module) -> dict[int, torch.Tensor | int]:
    """{global layer id: slots this rank's experts processed in the last forward}: references
    only, so the train loop can keep one per micro-batch inside the timed step for free."""
    return {m.layer_id: m.last_tokens_per_expert for m in moe_layers(model)}


def set_aux_loss_grad_scale(model: nn.Module, scale: float) -> None:
    for m in moe_layers(model):
        m.aux_loss_grad_scale = scale


def aux_loss_total(model: nn.Module) -> float:
    """Sum of the last forward's balance losses (host sync: call outside the timed region)."""
    losses = [m.last_aux_loss for m in moe_layers(model) if m.last_aux_loss is not None]
    return float(torch.stack(losses).sum()) if losses else 0.0
