"""Load-balance losses of the router, and how every MoE layer adds its loss to the objective.

The statistics of a loss span more than one rank under data or context parallelism; the sum
over those ranks is a `Reduction` that parallelize.py injects (model code stays single-device).
Shapes: the trainer's legend (moe_perf/trainer/__init__.py).
"""

from __future__ import annotations

from typing import Protocol

import torch


class Reduction(Protocol):
    """The sum of a tensor over the ranks of a group, in place (a collective in the step)."""

    size: int  # ranks in the group

    def __call__(self, t: torch.Tensor) -> torch.Tensor: ...


def global_batch_balance_loss(
    scores_TE, topk_idx_TK, reduce: Reduction | None = None
) -> torch.Tensor:
    """sum_e E * f_e * P_e with f_e counted over the whole data x context group.

    Global-batch balancing (Qiu et al. 2025, used by Qwen3): expert frequencies f_e are summed
    over every rank's tokens by `reduce` (over dp x cp); P_e is this rank's mean score.
    Averaging the per-rank losses (as data-parallel gradient averaging does) gives the loss over
    the global micro-batch.
    """
    T, K = topk_idx_TK.shape
    E = scores_TE.shape[1]
    # scatter_add rather than bincount: bincount's output size depends on the data, a graph
    # break under torch.compile (a frame more for dynamo to trace in every arm).
    idx_N = topk_idx_TK.reshape(-1)
    counts_E = torch.zeros(E, device=idx_N.device, dtype=scores_TE.dtype)
    counts_E.scatter_add_(0, idx_N, torch.ones_like(idx_N, dtype=scores_TE.dtype))
    total = torch.tensor(float(T * K), device=scores_TE.device)
    if reduce is not None:
        stats = reduce(torch.cat([counts_E, total.view(1)]))
        counts_E, total = stats[:E], stats[E]
    f_E = counts_E * E / total
    P_E = _normalised(scores_TE).mean(0)
    return (f_E * P_E).sum()


def sequence_balance_loss(
    scores_TE, topk_idx_TK, batch: int, reduce: Reduction | None = None
) -> torch.Tensor:
    """DeepSeek's sequence-wise balance loss: mean over sequences of sum_e f_e * P_e.

    f_e = E/(K*S) * (selections of e in the sequence), P_e = mean score in the sequence. Under
    context parallelism a sequence spans the cp group: `reduce` sums the counts there.
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
    if reduce is not None:
        counts_BE = reduce(counts_BE)
        seq_len = S * reduce.size
    f_BE = counts_BE * E / (K * seq_len)
    P_BE = _normalised(scores_TE).view(batch, S, E).mean(1)
    return (f_BE * P_BE).sum(1).mean()


def _normalised(scores_TE: torch.Tensor) -> torch.Tensor:
    # Softmax scores already sum to 1; sigmoid affinities are normalised per token (DeepSeek-V3).
    return scores_TE / scores_TE.sum(-1, keepdim=True)


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, aux_loss, grad_scale: float):
        ctx.grad_scale = grad_scale
        ctx.save_for_backward(aux_loss)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        (aux_loss,) = ctx.saved_tensors
        return grad_out, torch.full_like(aux_loss, ctx.grad_scale), None


def attach_aux_loss(out: torch.Tensor, aux_loss: torch.Tensor, grad_scale: float):
    """Identity on `out` whose backward also sends `grad_scale` into `aux_loss`.

    Lets every MoE layer add its balance loss to the objective without the model returning it,
    which also works on intermediate pipeline stages.
    """
    return _AttachAuxLoss.apply(out, aux_loss, grad_scale)
