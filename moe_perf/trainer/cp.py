"""Context parallel: zig-zag sequence sharding and exact causal attention across the cp group.

A sequence of A positions is cut into 2*cp chunks of C = A / (2*cp) positions; cp rank r holds
chunks r and 2*cp-1-r (S = 2*C positions). Under a causal mask, chunk c costs c+1 chunk-pairs of
attention, so every rank does (r+1) + (2*cp-r) = 2*cp+1 of them: the work is balanced.

Attention: each rank all-gathers K and V of the whole sequence (one collective per layer, K and
V packed together) and runs its local queries against them with a causal mask built from GLOBAL
positions; backward reduce-scatters the K/V gradients (the adjoint of the all-gather). This is
exact, not an approximation. Torch's built-in `context_parallel` shards attention only on
GPU (torch 2.13 has no CPU path), hence our own, which the CPU tests run. Memory: each rank
holds the full K/V of one layer at a time (G kv heads only).

Shapes: the trainer's legend (moe_perf/trainer/__init__.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from moe_perf.trainer.attention import Attention

# torch 2.13 renamed the single-tensor collectives; the GPU image (torch 2.11) has the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---------------------------------------------------------------------------------------------
# Zig-zag sharding


def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two global chunk indices that cp rank `rank` holds, in local order."""
    return rank, 2 * cp - 1 - rank


def zigzag_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions (int64, [S] with S = seq_len / cp) of the tokens cp rank `rank` holds."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} must be divisible by 2*cp = {2 * cp}")
    chunk = seq_len // (2 * cp)
    first, second = zigzag_chunks(cp, rank)
    return torch.cat(
        [
            torch.arange(first * chunk, (first + 1) * chunk, device=device),
            torch.arange(second * chunk, (second + 1) * chunk, device=device),
        ]
    )


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """The zig-zag shard of `x` along `dim` (tokens, labels or positions) for cp rank `rank`."""
    if cp == 1:
        return x
    chunks = x.chunk(2 * cp, dim=dim)
    if len(chunks) != 2 * cp or x.shape[dim] % (2 * cp):
        raise ValueError(f"size {x.shape[dim]} along dim {dim} is not divisible by 2*cp = {2 * cp}")
    first, second = zigzag_chunks(cp, rank)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def unshard_sequence(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of `shard_sequence`: shards of cp ranks 0..cp-1 back to the full sequence."""
    cp = len(shards)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        first, second = zigzag_chunks(cp, rank)
        chunks[first], chunks[second] = shard.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def shard_batch(
    tokens_BA: torch.Tensor, labels_BA: torch.Tensor, cp: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This cp rank's tokens_BS, labels_BS and global positions_BS (for RoPE and the mask).

    Labels are sharded exactly like tokens, so each rank's loss is over its own tokens; the
    mean over the cp group equals the full-sequence mean because every rank holds A/cp tokens.
    """
    B, A = tokens_BA.shape
    positions_S = zigzag_positions(A, cp, rank, device=tokens_BA.device)
    positions_BS = positions_S.unsqueeze(0).expand(B, -1)
    return (
        shard_sequence(tokens_BA, cp, rank),
        shard_sequence(labels_BA, cp, rank),
        positions_BS,
    )


# ---------------------------------------------------------------------------------------------
# Sequence all-gather with an exact backward


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 across `group`; backward sums the gradients and keeps our slice."""

    @staticmethod
    def forward(ctx, x_S: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        x_S = x_S.contiguous()
        out_A = x_S.new_empty((world * x_S.shape[0], *x_S.shape[1:]))
        _all_gather_single(out_A, x_S, group=group)
        return out_A

    @staticmethod
    def backward(ctx, grad_A: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        grad_A = grad_A.contiguous()
        grad_S = grad_A.new_empty((grad_A.shape[0] // world, *grad_A.shape[1:]))
        # Every rank's queries used our K/V: their gradients are summed where our slice lives.
        _reduce_scatter_single(grad_S, grad_A, group=ctx.group)
        return grad_S, None


def gather_sequence(x_BGSX: torch.Tensor, group) -> torch.Tensor:
    """[B, G, S, X] on each rank -> [B, G, A, X] (A = cp*S), rank-major (rank 0's first)."""
    x_SBGX = x_BGSX.permute(2, 0, 1, 3)
    return _GatherSequence.apply(x_SBGX, group).permute(1, 2, 0, 3)


# ---------------------------------------------------------------------------------------------
# Attention


def _key_positions(seq_len: int, cp: int, device: torch.device) -> torch.Tensor:
    """Global positions of the gathered keys, in gather (rank-major, zig-zag) order."""
    return torch.cat([zigzag_positions(seq_len, cp, r, device=device) for r in range(cp)])


def _natural_order(seq_len: int, cp: int, device: torch.device) -> torch.Tensor:
    """Index that reorders gathered keys (rank-major) into position order."""
    return torch.argsort(_key_positions(seq_len, cp, device))


def cp_attention(
    q_BHSd: torch.Tensor,
    k_BGSd: torch.Tensor,
    v_BGSv: torch.Tensor,
    positions_S: torch.Tensor,
    group,
    *,
    scale: float | None = None,
    window: int = 0,
    flash_friendly: bool | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's zig-zag queries against the whole sequence's K/V.

    `positions_S`: global positions of the local tokens (from `zigzag_positions`).
    `window` > 0: sliding window (a query sees keys at most window-1 positions back).
    `flash_friendly` (default: on CUDA without a window): two SDPA calls, one per local chunk,
    each against the key prefix it may see with a lower-right causal bias, so that no mask is
    materialized and flash attention stays eligible; K/V heads are expanded for GQA there
    because the lower-right kernels do not take `enable_gqa`. Otherwise one SDPA call with an
    explicit boolean mask (the CPU path).
    """
    cp = dist.get_world_size(group)
    B, H, S, d = q_BHSd.shape
    G = k_BGSd.shape[1]
    seq_len = cp * S
    # One collective for K and V together.
    kv_BGSX = torch.cat([k_BGSd, v_BGSv], dim=-1)
    kv_BGAX = gather_sequence(kv_BGSX, group)
    k_BGAd, v_BGAv = kv_BGAX.split([k_BGSd.shape[-1], v_BGSv.shape[-1]], dim=-1)

    if flash_friendly is None:
        flash_friendly = q_BHSd.is_cuda and window == 0
    if flash_friendly:
        if window:
            raise ValueError("the flash-friendly path does not support sliding windows")
        order_A = _natural_order(seq_len, cp, q_BHSd.device)
        k_BHAd = k_BGAd.index_select(2, order_A).repeat_interleave(H // G, dim=1)
        v_BHAv = v_BGAv.index_select(2, order_A).repeat_interleave(H // G, dim=1)
        C = S // 2
        outs = []
        # Chunk indices from the rank, not from positions_S: reading a GPU tensor would sync.
        chunk_ids = zigzag_chunks(cp, dist.get_rank(group))
        for c, q_BHCd in zip(chunk_ids, q_BHSd.split(C, dim=2), strict=True):
            end = (c + 1) * C
            bias = causal_lower_right(C, end)
            outs.append(
                F.scaled_dot_product_attention(
                    q_BHCd, k_BHAd[:, :, :end], v_BHAv[:, :, :end], attn_mask=bias, scale=scale
                )
            )
        return torch.cat(outs, dim=2)

    key_pos_A = _key_positions(seq_len, cp, q_BHSd.device)
    delta_SA = positions_S.unsqueeze(1) - key_pos_A.unsqueeze(0)
    mask_SA = delta_SA >= 0
    if window:
        mask_SA &= delta_SA < window
    return F.scaled_dot_product_attention(
        q_BHSd, k_BGAd, v_BGAv, attn_mask=mask_SA, scale=scale, enable_gqa=G != H
    )


# ---------------------------------------------------------------------------------------------
# Switching a model into context-parallel mode (parallelize.py)


class ContextParallelAttention:
    """Replacement for `Attention.attend` on a cp rank: zig-zag queries, gathered K/V."""

    def __init__(self, group, window: int = 0):
        self.group, self.window = group, window
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def __call__(self, q_BHSd, k_BGSd, v_BGSv):
        seq_len = self.cp * q_BHSd.shape[2]
        positions_S = zigzag_positions(seq_len, self.cp, self.rank, device=q_BHSd.device)
        return cp_attention(q_BHSd, k_BGSd, v_BGSv, positions_S, self.group, window=self.window)


def _fill_zigzag_positions(cp: int, rank: int):
    """Forward pre-hook: positions_BS = this rank's global (zig-zag) positions when not given.

    Pipeline stages receive only hidden states, so RoPE positions cannot come from the loop.
    """

    def hook(module, args, kwargs):
        if len(args) > 1 or kwargs.get("positions_BS") is not None:
            return None
        B, S = args[0].shape[:2]
        positions_S = zigzag_positions(cp * S, cp, rank, device=args[0].device)
        return args, {**kwargs, "positions_BS": positions_S.unsqueeze(0).expand(B, S)}

    return hook


def apply_context_parallel(model: torch.nn.Module, cp_group) -> None:
    """Put every attention of `model` (a Transformer or a pipeline stage of one) in CP mode.

    The batch itself is sharded by the train loop with `shard_batch` (tokens and labels;
    positions default to the zig-zag ones here). The sequence balance loss, whose sequence
    spans the cp group, gets its reduction from parallelize.py.
    """
    cp, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    for module in model.modules():
        if isinstance(module, Attention):
            module.attend = ContextParallelAttention(cp_group)
    model.register_forward_pre_hook(_fill_zigzag_positions(cp, rank), with_kwargs=True)
