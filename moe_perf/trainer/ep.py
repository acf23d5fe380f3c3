"""Expert parallel: each EP rank keeps its slice of the experts and dispatches by all-to-all.

Rank r of the EP group holds experts [r*E/ep, (r+1)*E/ep). The all-to-all dispatcher lives
beside the local one (dispatch.py); this module switches a model to it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_perf.trainer.dispatch import AllToAllDispatcher
from moe_perf.trainer.moe import moe_layers


def apply_expert_parallel(model: torch.nn.Module, ep_group: dist.ProcessGroup) -> None:
    """Keep this EP rank's experts of every MoE layer and send tokens to the ranks that hold
    theirs."""
    ep, ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    for m in moe_layers(model):
        shard_experts_(m.experts, ep_rank, ep)
        m.dispatcher = AllToAllDispatcher(ep_group, m.num_experts)


def shard_experts_(experts: torch.nn.Module, ep_rank: int, ep: int) -> None:
    """Keep only this EP rank's slice [r*E/ep, (r+1)*E/ep) of every expert weight (dim 0).

    The trainer slices the model while it is still on the meta device (nothing allocated);
    parallelize.py then materializes the slice, whose experts draw from their own streams by
    GLOBAL id (`first_expert`, experts.GroupedExperts.init_weights): the slice holds the values
    of the full model that one process builds from the same seed. On a model already
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
