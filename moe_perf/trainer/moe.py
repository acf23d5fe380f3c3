"""Mixture-of-experts feed-forward: router, forced balance, load-balance losses, experts.

Single-device code. Expert parallelism swaps `MoE.dispatcher` (LocalDispatcher here, an
all-to-all one in ep.py) and slices `GroupedExperts` weights on dim 0; `parallelize.py` does it.

Shape legend: B sequences, S positions per sequence on this rank, T = B*S tokens, D hidden,
E routed experts (global), L experts held by this module (E, or E/ep under EP), K top-k,
F expert FFN width, N routed (token, k) slots handled by the experts (T*K without EP).
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------------------------
# Initialisation streams


def init_seed(*keys) -> int:
    """A 63-bit seed determined by `keys` (ints and strings) alone: one independent random
    stream per key tuple, the same in every process (unlike Python's salted str hash)."""
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def init_generator(device: torch.device | str, *keys) -> torch.Generator:
    """A generator on `device` seeded from `keys` (its `initial_seed()` is that seed)."""
    return torch.Generator(device=device).manual_seed(init_seed(*keys))


# --------------------------------------------------------------------------------------------
# Forced balance (REFERENCE §3)


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
    of each other on any contiguous range of tokens otherwise. Consecutive slots of one token
    go to consecutive EP ranks (trap b: K slots of a token never pile onto one rank when K <= ep).
    """
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep={ep}")
    per_rank = num_experts // ep
    g_T1 = torch.arange(num_tokens, device=device, dtype=torch.long).unsqueeze(1)
    s_TK = (global_token_offset + g_T1) * top_k + torch.arange(top_k, device=device)
    return (s_TK % ep) * per_rank + (s_TK // ep) % per_rank


# --------------------------------------------------------------------------------------------
# Router


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


# --------------------------------------------------------------------------------------------
# Row permutations with gather-only backward
#
# x.index_select(0, idx) has a scatter-add (atomic index_add) as its backward. When idx is a
# permutation, or each token's K slots, the gradient is a gather by the inverse permutation
# instead: on an H200 that cut the routed-token permute backward by about half.


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv.scatter_(0, perm, torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype))
    return inv


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, perm, inv):
        ctx.save_for_backward(inv)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        (inv,) = ctx.saved_tensors
        return grad.index_select(0, inv), None, None


class _GatherSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, order_N, inv_N, top_k: int):
        ctx.save_for_backward(inv_N)
        ctx.top_k = top_k
        return x_TD.index_select(0, order_N // top_k)

    @staticmethod
    def backward(ctx, grad_ND):
        (inv_N,) = ctx.saved_tensors
        grad_TKD = grad_ND.index_select(0, inv_N).view(-1, ctx.top_k, grad_ND.shape[-1])
        return grad_TKD.sum(1), None, None, None


def permute_rows(x: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """x[perm] for a permutation `perm` whose inverse is `inv`."""
    return _PermuteRows.apply(x, perm, inv)


def gather_slots(x_TD: torch.Tensor, order_N: torch.Tensor, inv_N: torch.Tensor, top_k: int):
    """Rows x_TD[order_N // K]: the (token, k) slots s = t*K + k of x_TD in the order order_N
    (a permutation of T*K slots, inverse inv_N); backward sums each token's K slot gradients."""
    return _GatherSlots.apply(x_TD, order_N, inv_N, top_k)


# --------------------------------------------------------------------------------------------
# Dispatch (single device)


class LocalDispatcher:
    """Groups the (token, k) slots by expert for the experts, and puts results back.

    dispatch(x_TD, topk_idx_TK) -> (x_ND sorted by expert, tokens_per_expert_L, state)
    combine(y_ND, state) -> y_TKD in the original (token, k) order
    """

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor):
        K = topk_idx_TK.shape[1]
        idx_N = topk_idx_TK.reshape(-1)
        order_N = torch.argsort(idx_N, stable=True)
        # scatter_add rather than bincount: a fixed output size, which torch.compile can trace.
        tokens_per_expert_L = torch.zeros(
            self.num_experts, dtype=torch.long, device=idx_N.device
        ).scatter_add_(0, idx_N, torch.ones_like(idx_N))
        inv_N = inverse_permutation(order_N)
        x_ND = gather_slots(x_TD, order_N, inv_N, K)
        return x_ND, tokens_per_expert_L, (order_N, inv_N, topk_idx_TK.shape)

    def combine(self, y_ND: torch.Tensor, state) -> torch.Tensor:
        order_N, inv_N, (T, K) = state
        return permute_rows(y_ND, inv_N, order_N).view(T, K, -1)


# --------------------------------------------------------------------------------------------
# Experts


def swiglu(gate: torch.Tensor, up: torch.Tensor, clamp: float) -> torch.Tensor:
    if clamp <= 0:
        return F.silu(gate) * up
    # gpt-oss: clamped gate and up, gate * sigmoid(1.702 gate) * (up + 1).
    gate = gate.clamp(max=clamp)
    up = up.clamp(-clamp, clamp)
    return gate * torch.sigmoid(1.702 * gate) * (up + 1)


def _grouped_mm_ok(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """torch._grouped_mm needs row strides that are multiples of 16 bytes; bf16 on CUDA."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.is_cuda and x.dtype != torch.bfloat16:
        return False
    return all(
        (t.shape[-1] * t.element_size()) % 16 == 0 and (t.shape[-2] * t.element_size()) % 16 == 0
        for t in (x, *weights)
    )


class GroupedExperts(nn.Module):
    """L SwiGLU experts as stacked weights: w1, w3 [L, D, F], w2 [L, F, D].

    forward(x_ND, tokens_per_expert_L): rows of x_ND are grouped by expert in order 0..L-1.
    EP keeps rank r's slice [r*E/ep, (r+1)*E/ep) of every weight, sets num_experts to L and
    first_expert (the global id of local expert 0) to r*E/ep.
    """

    def __init__(self, num_experts: int, dim: int, ffn: int, swiglu_clamp: float = 0.0):
        super().__init__()
        self.num_experts = num_experts
        self.first_expert = 0
        self.swiglu_clamp = swiglu_clamp
        self.backend = "auto"  # auto: _grouped_mm where it runs, else loop | grouped_mm | loop
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, ffn))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, ffn))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn, dim))

    def init_weights(self, std: float, out_std: float, generator=None) -> None:
        """Truncated normal weights.

        With `generator` (the model's per-unit init, model.Transformer.init_weights) expert e
        of each weight draws from its own stream, seeded from (the generator's seed, weight
        name, GLOBAL expert id first_expert + e), and nothing from `generator` itself: an EP
        rank that holds only experts [first, first + L) initialises exactly their slice of the
        full layer, without ever allocating the full layer. Without, the global RNG fills
        whole tensors.
        """
        for name, s in (("w1", std), ("w3", std), ("w2", out_std)):
            w = getattr(self, name)
            if generator is None:
                nn.init.trunc_normal_(w, std=s)
                continue
            unit = generator.initial_seed()
            for e in range(w.shape[0]):
                g = init_generator(w.device, unit, name, self.first_expert + e)
                nn.init.trunc_normal_(w[e], std=s, generator=g)

    def forward(self, x_ND: torch.Tensor, tokens_per_expert_L: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = self.w1, self.w2, self.w3
        if torch.is_autocast_enabled(x_ND.device.type):
            # _grouped_mm has no autocast rule: cast by hand to the autocast dtype.
            dt = torch.get_autocast_dtype(x_ND.device.type)
            x_ND, w1, w2, w3 = x_ND.to(dt), w1.to(dt), w2.to(dt), w3.to(dt)
        use_grouped = self.backend == "grouped_mm" or (
            self.backend == "auto" and _grouped_mm_ok(x_ND, w1, w2, w3)
        )
        if use_grouped:
            # Rows past offsets[-1] come back uninitialised; there are none here (N = sum).
            offsets_L = torch.cumsum(tokens_per_expert_L, 0, dtype=torch.int32)
            h_NF = swiglu(
                torch._grouped_mm(x_ND, w1, offs=offsets_L),
                torch._grouped_mm(x_ND, w3, offs=offsets_L),
                self.swiglu_clamp,
            )
            return torch._grouped_mm(h_NF, w2, offs=offsets_L)
        return self._loop(x_ND, tokens_per_expert_L, w1, w2, w3)

    def _loop(self, x_ND, tokens_per_expert_L, w1, w2, w3) -> torch.Tensor:
        """Per-expert matmuls on slices (a host sync for the counts)."""
        outs, start = [], 0
        for e, n in enumerate(tokens_per_expert_L.tolist()):
            x = x_ND[start : start + n]
            outs.append(swiglu(x @ w1[e], x @ w3[e], self.swiglu_clamp) @ w2[e])
            start += n
        return torch.cat(outs) if outs else x_ND.new_zeros(0, w2.shape[-1])


class FeedForward(nn.Module):
    """Dense SwiGLU MLP: leading dense layers and (merged) shared experts."""

    def __init__(self, dim: int, ffn: int, swiglu_clamp: float = 0.0):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)
        self.swiglu_clamp = swiglu_clamp

    def init_weights(self, std: float, out_std: float, generator=None) -> None:
        for w in (self.w1, self.w3):
            nn.init.trunc_normal_(w.weight, std=std, generator=generator)
        nn.init.trunc_normal_(self.w2.weight, std=out_std, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x), self.swiglu_clamp))


# --------------------------------------------------------------------------------------------
# Load-balance losses


def global_batch_balance_loss(scores_TE, topk_idx_TK, group) -> torch.Tensor:
    """sum_e E * f_e * P_e with f_e counted over the whole data x context group.

    Global-batch balancing (Qiu et al. 2025, used by Qwen3): expert frequencies f_e are summed
    over every rank's tokens by an all_reduce (a real collective in the step); P_e is this
    rank's mean score. Averaging the per-rank losses (as data-parallel gradient averaging does)
    gives the loss over the global micro-batch.
    """
    T, K = topk_idx_TK.shape
    E = scores_TE.shape[1]
    counts_E = torch.bincount(topk_idx_TK.reshape(-1), minlength=E).to(scores_TE.dtype)
    total = torch.tensor(float(T * K), device=scores_TE.device)
    if group is not None:
        stats = torch.cat([counts_E, total.view(1)])
        dist.all_reduce(stats, group=group)
        counts_E, total = stats[:E], stats[E]
    f_E = counts_E * E / total
    P_E = _normalised(scores_TE).mean(0)
    return (f_E * P_E).sum()


def sequence_balance_loss(scores_TE, topk_idx_TK, batch: int, group) -> torch.Tensor:
    """DeepSeek's sequence-wise balance loss: mean over sequences of sum_e f_e * P_e.

    f_e = E/(K*S) * (selections of e in the sequence), P_e = mean score in the sequence. Under
    context parallelism a sequence spans `group` (the cp group): counts are all-reduced there.
    """
    T, K = topk_idx_TK.shape
    E = scores_TE.shape[1]
    S = T // batch
    counts_BE = torch.zeros(batch, E, device=scores_TE.device, dtype=scores_TE.dtype)
    counts_BE.scatter_add_(
        1,
        topk_idx_TK.reshape(batch, S * K),
        torch.ones(batch, S * K, device=scores_TE.device, dtype=scores_TE.dtype),
    )
    seq_len = S
    if group is not None:
        dist.all_reduce(counts_BE, group=group)
        seq_len = S * dist.get_world_size(group)
    f_BE = counts_BE * E / (K * seq_len)
    P_BE = _normalised(scores_TE).view(batch, S, E).mean(1)
    return (f_BE * P_BE).sum(1).mean()


def _normalised(scores_TE: torch.Tensor) -> torch.Tensor:
    # Softmax scores already sum to 1; sigmoid affinities are normalised per token (DeepSeek-V3).
    return scores_TE / scores_TE.sum(-1, keepdim=True)


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on `out` whose backward also sends `grad_scale` into `aux_loss`.

    Lets every MoE layer add its balance loss to the objective without the model returning it,
    which also works on intermediate pipeline stages.
    """

    @staticmethod
    def forward(ctx, out, aux_loss, grad_scale: float):
        ctx.grad_scale = grad_scale
        ctx.save_for_backward(aux_loss)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        (aux_loss,) = ctx.saved_tensors
        return grad_out, torch.full_like(aux_loss, ctx.grad_scale), None


# --------------------------------------------------------------------------------------------
# The MoE block


class MoE(nn.Module):
    """Routed SwiGLU experts (+ shared experts), forced balance, and the balance loss.

    Attributes set from outside (not parameters):
      global_token_offset  global index of this rank's first token of the current micro-batch
                           (forced balance), kept in the `token_offset` buffer;
                           `set_token_offset(model, offset)` sets all layers.
      load_balance_group   data x context process group for the global-batch loss (None: one
                           process); cp_group for the sequence loss under context parallel.
      aux_loss_grad_scale  gradient the balance loss gets per backward (1/micro-batches).
      last_aux_loss        detached balance loss of the last forward (for logging).
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
    ):
        super().__init__()
        if load_balance not in ("global-batch", "sequence"):
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
        self.force_balance, self.balance_ep = force_balance, balance_ep
        if force_balance and num_experts % balance_ep:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep={balance_ep}")
        # A 0-d tensor, not a Python int: torch.compile would specialize on (and recompile
        # for) every new int offset; a tensor value is not guarded.
        self.register_buffer("token_offset", torch.zeros((), dtype=torch.long), persistent=False)
        self.load_balance_group = None
        self.cp_group = None
        self.aux_loss_grad_scale = 1.0
        self.last_aux_loss: torch.Tensor | None = None

    @property
    def global_token_offset(self) -> int:
        return int(self.token_offset)  # a host sync: for tests and logs only

    @global_token_offset.setter
    def global_token_offset(self, offset: int) -> None:
        self.token_offset.fill_(offset)  # in place: no sync, and compiled code sees the value

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
        if self.force_balance:
            idx_TK = forced_expert_ids(
                self.token_offset,
                x_TD.shape[0],
                self.top_k,
                self.num_experts,
                self.balance_ep,
                x_TD.device,
            )
        return scores_TE, real_idx_TK, idx_TK, self.router.gating(scores_TE, idx_TK)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        scores_TE, real_idx_TK, idx_TK, weights_TK = self.route(x_TD)

        x_ND, tokens_per_expert_L, state = self.dispatcher.dispatch(x_TD, idx_TK)
        y_ND = self.experts(x_ND, tokens_per_expert_L)
        y_TKD = self.dispatcher.combine(y_ND, state)
        # sum_k w_TK * y_TKD: elementwise and a reduction (fused under compile); a bmm of
        # T [1,K] @ [K,D] products ran at a few TFLOP/s.
        out_TD = (y_TKD * weights_TK.to(y_TKD.dtype).unsqueeze(-1)).sum(1)

        if self.shared is not None:
            shared_TD = self.shared(x_TD)
            if self.shared_gate is not None:
                shared_TD = torch.sigmoid(self.shared_gate(x_TD)) * shared_TD
            out_TD = out_TD + shared_TD
        out_BSD = out_TD.view(B, S, D)

        if self.load_balance_coeff > 0 and self.training:
            # The loss is computed on the router's own choice (real_idx), which is what it
            # trains; under forced balance the dispatched ids are uniform by construction.
            aux = self.balance_loss(scores_TE, real_idx_TK, B) * self.load_balance_coeff
            self.last_aux_loss = aux.detach()
            if torch.is_grad_enabled():
                out_BSD = _AttachAuxLoss.apply(out_BSD, aux, self.aux_loss_grad_scale)
        return out_BSD

    def balance_loss(self, scores_TE, topk_idx_TK, batch: int) -> torch.Tensor:
        if self.load_balance == "global-batch":
            return global_batch_balance_loss(scores_TE, topk_idx_TK, self.load_balance_group)
        return sequence_balance_loss(scores_TE, topk_idx_TK, batch, self.cp_group)


# --------------------------------------------------------------------------------------------
# Helpers for the train loop and parallelize.py


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_token_offset(model: nn.Module, offset: int) -> None:
    """Global index of this rank's first token in the micro-batch about to run (forced balance).

    offset = (microbatch_idx * dp_cp_world + dp_cp_rank) * tokens_per_microbatch.
    """
    for m in moe_layers(model):
        m.global_token_offset = offset


def set_aux_loss_grad_scale(model: nn.Module, scale: float) -> None:
    for m in moe_layers(model):
        m.aux_loss_grad_scale = scale


def aux_loss_total(model: nn.Module) -> float:
    """Sum of the last forward's balance losses (host sync: call outside the timed region)."""
    losses = [m.last_aux_loss for m in moe_layers(model) if m.last_aux_loss is not None]
    return float(torch.stack(losses).sum()) if losses else 0.0
