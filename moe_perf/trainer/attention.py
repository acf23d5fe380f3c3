"""Causal grouped-query attention with (partial) rotary embeddings, single device.

Context parallel replaces `Attention.attend` (cp.py); the projections and RoPE stay here.
Shapes: the trainer's legend (moe_perf/trainer/__init__.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_perf.common.config import ModelConfig
from moe_perf.trainer.layers import RMSNorm


def rotary_dims(head_dim: int, fraction: float) -> int:
    """Rotated dims (even): partial RoPE rotates the first fraction of each head."""
    return 2 * int(round(head_dim * fraction / 2))


def rope_cos_sin(positions_BS: torch.Tensor, rot_dims: int, theta: float):
    """cos, sin [B, 1, S, R/2] in fp32 for the given absolute positions (CP passes zig-zag)."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, rot_dims, 2, device=positions_BS.device, dtype=torch.float32) / rot_dims
    )
    angles_BSR = positions_BS.float().unsqueeze(-1) * inv_freq
    return angles_BSR.cos().unsqueeze(1), angles_BSR.sin().unsqueeze(1)


def apply_rope(x_BHSd: torch.Tensor, cos, sin) -> torch.Tensor:
    """Rotate-half RoPE (GPT-NeoX/Llama-HF layout) on the first R dims of each head."""
    R = cos.shape[-1] * 2
    rot, rest = x_BHSd[..., :R], x_BHSd[..., R:]
    x1, x2 = rot.float().chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_BHSd.dtype)
    return torch.cat([rotated, rest], dim=-1) if rest.shape[-1] else rotated


def causal_attention(q_BHSd, k_BGSd, v_BGSv) -> torch.Tensor:
    """Causal GQA attention; SDPA picks flash/cuDNN kernels on GPU."""
    return F.scaled_dot_product_attention(
        q_BHSd, k_BGSd, v_BGSv, is_causal=True, enable_gqa=q_BHSd.shape[1] != k_BGSd.shape[1]
    )


class Attention(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv = m.num_heads, m.num_kv_heads
        self.head_dim = m.head_dim
        self.v_head_dim = m.v_head_dim or m.head_dim
        self.wq = nn.Linear(m.hidden, m.num_heads * m.head_dim, bias=False)
        self.wk = nn.Linear(m.hidden, m.num_kv_heads * m.head_dim, bias=False)
        self.wv = nn.Linear(m.hidden, m.num_kv_heads * self.v_head_dim, bias=False)
        self.wo = nn.Linear(m.num_heads * self.v_head_dim, m.hidden, bias=False)
        self.q_norm = RMSNorm(m.head_dim, m.norm_eps) if m.qk_norm else None
        self.k_norm = RMSNorm(m.head_dim, m.norm_eps) if m.qk_norm else None
        self.attend = causal_attention  # context parallel swaps this

    def init_weights(self, std: float, out_std: float, generator=None) -> None:
        for w in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(w.weight, std=std, generator=generator)
        nn.init.trunc_normal_(self.wo.weight, std=out_std, generator=generator)
        for n in (self.q_norm, self.k_norm):
            if n is not None:
                n.init_weights()

    def forward(self, x_BSD: torch.Tensor, rope: tuple | None) -> torch.Tensor:
        """`rope`: the (cos, sin) tables of this micro-batch's positions (`rope_cos_sin`), built
        once per forward by the model and shared by its layers; None without RoPE."""
        B, S, _ = x_BSD.shape
        q_BHSd = self.wq(x_BSD).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)
        k_BGSd = self.wk(x_BSD).view(B, S, self.n_kv, self.head_dim).transpose(1, 2)
        v_BGSv = self.wv(x_BSD).view(B, S, self.n_kv, self.v_head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q_BHSd, k_BGSd = self.q_norm(q_BHSd), self.k_norm(k_BGSd)
        if rope is not None:
            q_BHSd, k_BGSd = apply_rope(q_BHSd, *rope), apply_rope(k_BGSd, *rope)
        o_BHSv = self.attend(q_BHSd, k_BGSd, v_BGSv)
        return self.wo(o_BHSv.transpose(1, 2).reshape(B, S, self.n_heads * self.v_head_dim))
