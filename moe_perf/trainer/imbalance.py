"""The routing a step really had: slots per expert and per rank, as the dispatchers counted them.

Inside the timed step each MoE layer only keeps a reference to the counts its dispatcher made
anyway (moe.MoE.last_tokens_per_expert), and the loop keeps one reference per micro-batch
(moe.tokens_processed): no kernel, no copy. After the step, outside the timed region, one small
all-reduce gathers them into `StepCounts`, a [layers, E + dp*cp] table:

    row l = the model's global layer l (layers of other pipeline stages filled by their ranks;
            dense layers stay zero)
    [:E]  slots expert e processed in the step, over every micro-batch and rank
    [E:]  slots the experts of dp*cp rank d processed (a device's load; under EP that is what
          its EP rank received)

`expert_imbalance` and `rank_imbalance` are each row's max over mean, averaged over the MoE
layers (under forced routing every layer routes alike; with the router's own top-k they
differ, and the mean is the step's typical layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class StepCounts:
    """One step's counts, the same on every rank after the gather."""

    table: torch.Tensor  # [layers, E + dp*cp], int64 on the CPU
    num_experts: int

    def rows(self) -> torch.Tensor:
        """The MoE layers' rows (dense layers and empty rows dropped)."""
        return self.table[self.table[:, : self.num_experts].sum(1) > 0]

    def expert_counts(self) -> torch.Tensor:
        return self.rows()[:, : self.num_experts]

    def rank_loads(self) -> torch.Tensor:
        return self.rows()[:, self.num_experts :]

    @property
    def expert_imbalance(self) -> float | None:
        return _max_over_mean(self.expert_counts())

    @property
    def rank_imbalance(self) -> float | None:
        return _max_over_mean(self.rank_loads())


def _max_over_mean(counts_LX: torch.Tensor) -> float | None:
    if counts_LX.numel() == 0:
        return None
    counts_LX = counts_LX.double()
    return float((counts_LX.max(1).values / counts_LX.mean(1)).mean())


def gather(per_microbatch: list[dict], *, num_layers: int, num_experts: int, ep: int,
           ep_rank: int, dp_cp_rank: int, dp_cp: int, device) -> StepCounts:  # fmt: skip
    """The step's StepCounts from this rank's per-micro-batch counts ({layer: counts of its
    E/ep local experts, or one count of each}, moe.tokens_processed), summed over the world.

    The collective this adds to a step: one all-reduce (sum) of layers x (E + dp*cp) int64
    over every rank, and its host copy, outside the timed region."""
    table = torch.zeros(num_layers, num_experts + dp_cp, dtype=torch.long, device=device)
    L = num_experts // ep
    for counts in per_microbatch:
        for layer, local_L in counts.items():
            if isinstance(local_L, int):  # every local expert got that many (moe.py)
                local_L = torch.full((L,), local_L, dtype=torch.long, device=device)
            table[layer, ep_rank * L : (ep_rank + 1) * L] += local_L
            table[layer, num_experts + dp_cp_rank] += local_L.sum()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(table)
    return StepCounts(table.cpu(), num_experts)
