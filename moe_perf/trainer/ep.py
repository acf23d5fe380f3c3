"""Expert parallel: all-to-all token dispatch and combine across an expert-parallel group.

Rank r of the EP group holds experts [r*E/ep, (r+1)*E/ep). `AllToAllDispatcher` has the same
interface as the single-device `LocalDispatcher` in moe.py, so the MoE block does not know whether
its experts are local or spread over ranks; `parallelize.py` swaps one for the other.

Shape legend: T tokens on this rank, K top-k, D hidden, E experts (global), L = E/ep local
experts, S = T*K routed slots sent by this rank, N routed slots received by this rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from moe_perf.trainer.moe import gather_slots, inverse_permutation, permute_rows


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

    order_S: torch.Tensor  # sorted slot -> original (token, k) slot
    inv_order_S: torch.Tensor  # original (token, k) slot -> sorted slot
    recv_perm_N: torch.Tensor  # expert-sorted row -> received row
    inv_recv_perm_N: torch.Tensor  # received row -> its row in the expert-sorted buffer
    send_splits: list[int]  # slots sent to each EP rank
    recv_splits: list[int]  # slots received from each EP rank
    num_tokens: int
    top_k: int


class AllToAllDispatcher:
    """Sends each (token, k) slot to the EP rank that owns its expert and brings results back.

    dispatch(x_TD, topk_idx_TK) -> (x_ND sorted by local expert, tokens_per_expert_L, state)
    combine(y_ND, state) -> y_TKD in the original (token, k) order

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
        E, L, ep = self.num_experts, self.num_local_experts, self.ep
        idx_S = topk_idx_TK.reshape(-1)
        # Sorting by global expert id also groups slots by destination rank (experts are
        # contiguous per rank), which is the layout all_to_all_single wants.
        order_S = torch.argsort(idx_S, stable=True)
        inv_order_S = inverse_permutation(order_S)
        x_SD = gather_slots(x_TD, order_S, inv_order_S, K)
        send_counts_E = torch.bincount(idx_S, minlength=E)

        # recv_counts[s, l]: slots rank s sends to my local expert l.
        recv_counts_flat = torch.empty_like(send_counts_E)
        dist.all_to_all_single(recv_counts_flat, send_counts_E, group=self.ep_group)
        recv_counts_EpL = recv_counts_flat.view(ep, L)
        # One host sync for both split lists.
        both = torch.cat([send_counts_E.view(ep, L).sum(1), recv_counts_EpL.sum(1)]).tolist()
        send_splits, recv_splits = both[:ep], both[ep:]

        x_recv_ND = all_to_all_autograd(x_SD, recv_splits, send_splits, self.ep_group)

        # Received rows arrive grouped by source rank, then by local expert; regroup by expert.
        N = sum(recv_splits)
        local_ids = torch.arange(L, device=x_TD.device).repeat(ep)
        row_expert_N = torch.repeat_interleave(local_ids, recv_counts_flat, output_size=N)
        recv_perm_N = torch.argsort(row_expert_N, stable=True)
        inv_recv_perm_N = inverse_permutation(recv_perm_N)
        x_ND = permute_rows(x_recv_ND, recv_perm_N, inv_recv_perm_N)
        tokens_per_expert_L = recv_counts_EpL.sum(0)

        state = DispatchState(
            order_S=order_S,
            inv_order_S=inv_order_S,
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
        y_SD = all_to_all_autograd(y_recv_ND, state.send_splits, state.recv_splits, self.ep_group)
        y_SD = permute_rows(y_SD, state.inv_order_S, state.order_S)
        return y_SD.view(state.num_tokens, state.top_k, -1)


def shard_experts_(experts: torch.nn.Module, ep_rank: int, ep: int) -> None:
    """Keep only this EP rank's slice [r*E/ep, (r+1)*E/ep) of every expert weight (dim 0).

    The trainer slices the model while it is still on the meta device (nothing allocated);
    parallelize.py then materializes the slice, whose experts draw from their own streams by
    GLOBAL id (`first_expert`, moe.GroupedExperts.init_weights): the slice holds the values of
    the full model that one process builds from the same seed. On a model already
    materialized (tests) the slice is copied out of the full weights.
    """
    for name, param in list(experts.named_parameters(recurse=False)):
        E = param.shape[0]
        if E % ep:
            raise ValueError(f"expert weight {name} has {E} experts, not divisible by ep={ep}")
        L = E // ep
        local = param.detach()[ep_rank * L : (ep_rank + 1) * L].clone()
        setattr(experts, name, torch.nn.Parameter(local, requires_grad=param.requires_grad))
    if hasattr(experts, "num_experts"):
        L = experts.num_experts // ep
        experts.first_expert = getattr(experts, "first_expert", 0) + ep_rank * L
        experts.num_experts = L
