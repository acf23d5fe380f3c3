"""Token dispatch: group the (token, k) slots by expert for the experts, and put results back.

Two dispatchers with one interface, side by side:

    dispatch(x_TD, topk_idx_TK) -> (x_ND sorted by local expert, tokens_per_expert_L, state)
    combine(y_ND, state) -> y_TKD in the original (token, k) order

`LocalDispatcher` when every expert is on this device; `AllToAllDispatcher` under expert
parallelism, where rank r of the EP group holds experts [r*E/ep, (r+1)*E/ep) and slots travel
by all-to-all. The MoE block does not know which one it has; parallelize.py (ep.py) swaps them.
Shapes: the trainer's legend (moe_perf/trainer/__init__.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

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
# Single device


class LocalDispatcher:
    """Every expert on this device: a stable sort of the T*K slots by expert (N = T*K)."""

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

    def dispatch_round_robin(self, x_TD: torch.Tensor, top_k: int):
        """`dispatch` for slots routed round-robin: slot s = t*K + k to expert s mod E (forced
        balance on one EP rank with offset*K a multiple of E, routing.forced_expert_ids).

        The stable sort by expert is then known in advance: expert e's slots are e, e + E,
        e + 2E, ..., so x_ND viewed [E, N/E, D] is the slots viewed [N/E, E, D] transposed.
        Strided copies instead of a sort, an inverse permutation and two index gathers (and
        the backward is a transpose and a sum over K); the same rows in the same order.
        """
        T, D = x_TD.shape
        E = self.num_experts
        N = T * top_k
        if N % E:
            raise ValueError(f"round-robin dispatch needs T*K={N} divisible by E={E}")
        J = N // E  # slots per expert
        if E % top_k == 0:
            # E = Q*K: expert e = q*K + k takes tokens j*Q + q (j < J), each once: one copy
            Q = E // top_k
            x_QKJD = x_TD.view(J, Q, D).transpose(0, 1).unsqueeze(1).expand(Q, top_k, J, D)
            x_ND = x_QKJD.reshape(N, D)
        else:
            x_ND = x_TD.unsqueeze(1).expand(T, top_k, D).reshape(J, E, D).transpose(0, 1)
            x_ND = x_ND.reshape(N, D)
        tokens_per_expert_L = torch.full((E,), J, dtype=torch.long, device=x_TD.device)
        return x_ND, tokens_per_expert_L, RoundRobin(T, top_k)

    def combine(self, y_ND: torch.Tensor, state) -> torch.Tensor:
        if isinstance(state, RoundRobin):
            T, K = state
            E = self.num_experts
            return y_ND.view(E, T * K // E, -1).transpose(0, 1).reshape(T, K, -1)
        order_N, inv_N, (T, K) = state
        return permute_rows(y_ND, inv_N, order_N).view(T, K, -1)


class RoundRobin(NamedTuple):
    """LocalDispatcher's state after `dispatch_round_robin`: the slots' shape."""

    num_tokens: int
    top_k: int


# --------------------------------------------------------------------------------------------
# Expert parallel: all-to-all over the EP group


def all_to_all_autograd(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Uneven all_to_all_single whose backward is the reverse all_to_all (splits swapped).

    The functional collective is traceable by torch.compile; the wait makes the result usable
    in eager mode on every backend.
    """
    out = funcol.all_to_all_single_autograd(x.contiguous(), output_splits, input_splits, group)
    return funcol.wait_tensor(out)


@dataclass
class DispatchState:
    """What combine needs to undo dispatch."""

    order_Q: torch.Tensor  # sorted slot -> original (token, k) slot
    inv_order_Q: torch.Tensor  # original (token, k) slot -> sorted slot
    recv_perm_N: torch.Tensor  # expert-sorted row -> received row
    inv_recv_perm_N: torch.Tensor  # received row -> its row in the expert-sorted buffer
    send_splits: list[int]  # slots sent to each EP rank
    recv_splits: list[int]  # slots received from each EP rank
    num_tokens: int
    top_k: int


class AllToAllDispatcher:
    """Sends each (token, k) slot to the EP rank that owns its expert and brings results back.

    Costs per call: one small all_to_all of counts followed by a device-to-host copy of the
    split sizes (a host sync on GPU: uneven all_to_all needs the splits on the host), then one
    all_to_all of tokens in dispatch and one in combine (and their mirrors in backward).
    """

    def __init__(self, ep_group: dist.ProcessGroup, num_experts: int):
        self.ep_group = ep_group
        self.ep = dist.get_world_size(ep_group)
        self.ep_rank = dist.get_rank(ep_group)
        if num_experts % self.ep:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep={self.ep}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep

    @property
    def local_expert_range(self) -> tuple[int, int]:
        start = self.ep_rank * self.num_local_experts
        return start, start + self.num_local_experts

    # Eager under torch.compile: the split sizes are host ints that change with routing, and
    # a compiled graph specialised on them would recompile; the block compiles around them.
    @torch.compiler.disable
    def dispatch(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor):
        T, K = topk_idx_TK.shape
        E, L, P = self.num_experts, self.num_local_experts, self.ep
        idx_Q = topk_idx_TK.reshape(-1)
        # Sorting by global expert id also groups slots by destination rank (experts are
        # contiguous per rank), which is the layout all_to_all_single wants.
        order_Q = torch.argsort(idx_Q, stable=True)
        inv_order_Q = inverse_permutation(order_Q)
        x_QD = gather_slots(x_TD, order_Q, inv_order_Q, K)
        send_counts_E = torch.bincount(idx_Q, minlength=E)

        # recv_counts_PL[p, l]: slots EP rank p sends to my local expert l.
        recv_counts_flat = torch.empty_like(send_counts_E)
        dist.all_to_all_single(recv_counts_flat, send_counts_E, group=self.ep_group)
        recv_counts_PL = recv_counts_flat.view(P, L)
        # One host sync for both split lists.
        both = torch.cat([send_counts_E.view(P, L).sum(1), recv_counts_PL.sum(1)]).tolist()
        send_splits, recv_splits = both[:P], both[P:]

        x_recv_ND = all_to_all_autograd(x_QD, recv_splits, send_splits, self.ep_group)

        # Received rows arrive grouped by source rank, then by local expert; regroup by expert.
        N = sum(recv_splits)
        local_ids = torch.arange(L, device=x_TD.device).repeat(P)
        row_expert_N = torch.repeat_interleave(local_ids, recv_counts_flat, output_size=N)
        recv_perm_N = torch.argsort(row_expert_N, stable=True)
        inv_recv_perm_N = inverse_permutation(recv_perm_N)
        x_ND = permute_rows(x_recv_ND, recv_perm_N, inv_recv_perm_N)
        tokens_per_expert_L = recv_counts_PL.sum(0)

        state = DispatchState(
            order_Q=order_Q,
            inv_order_Q=inv_order_Q,
            recv_perm_N=recv_perm_N,
            inv_recv_perm_N=inv_recv_perm_N,
            send_splits=send_splits,
            recv_splits=recv_splits,
            num_tokens=T,
            top_k=K,
        )
        return x_ND, tokens_per_expert_L, state

    @torch.compiler.disable
    def combine(self, y_ND: torch.Tensor, state: DispatchState) -> torch.Tensor:
        y_recv_ND = permute_rows(y_ND, state.inv_recv_perm_N, state.recv_perm_N)
        y_QD = all_to_all_autograd(y_recv_ND, state.send_splits, state.recv_splits, self.ep_group)
        y_QD = permute_rows(y_QD, state.inv_order_Q, state.order_Q)
        return y_QD.view(state.num_tokens, state.top_k, -1)
