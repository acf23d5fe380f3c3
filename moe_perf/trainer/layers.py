"""Dense building blocks shared by the attention, dense and MoE layers, and the seeded init streams.

Shapes: the trainer's legend (moe_perf/trainer/__init__.py).
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import nn


def init_seed(*keys) -> int:
    """A 63-bit seed determined by `keys` (ints and strings) alone: one independent random
    stream per key tuple, the same in every process (unlike Python's salted str hash)."""
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def init_generator(device: torch.device | str, *keys) -> torch.Generator:
    """A generator on `device` seeded from `keys` (its `initial_seed()` is that seed)."""
    return torch.Generator(device=device).manual_seed(init_seed(*keys))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In x's dtype: CUDA's autocast runs rms_norm in fp32 and returns fp32 (CPU's does not),
        # which made the norms' outputs, and from the MoE's sum on the residual stream, fp32.
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor, clamp: float) -> torch.Tensor:
    if clamp <= 0:
        return F.silu(gate) * up
    # gpt-oss: clamped gate and up, gate * sigmoid(1.702 gate) * (up + 1).
    gate = gate.clamp(max=clamp)
    up = up.clamp(-clamp, clamp)
    return gate * torch.sigmoid(1.702 * gate) * (up + 1)


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
