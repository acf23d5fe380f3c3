"""The routed experts: L SwiGLU FFNs as stacked weights, one grouped matmul per weight (the
gate and up projections are one weight, so one matmul).

Shapes: the trainer's legend (moe_perf/trainer/__init__.py).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from moe_perf.trainer.layers import init_generator, swiglu

# The profiler span around the routed experts' compute: explain (report/explain/) counts what
# runs inside it, and its backward, as expert time.
EXPERT_SCOPE = "moe_perf.experts"


def expert_scope() -> AbstractContextManager:
    """The EXPERT_SCOPE span while a profiler runs in eager mode; nothing otherwise (a
    record_function costs a dispatcher call per use even with no profiler). Compiled code never
    reads the profiler flag: torch.compile would guard on it and recompile every block when a
    profiler starts."""
    if torch.compiler.is_compiling() or not torch.autograd.profiler._is_profiler_enabled:
        return nullcontext()
    return torch.profiler.record_function(EXPERT_SCOPE)


# The experts' batched matmul as an op of its own, forward and backward: under torch.compile no
# profiler scope survives, and a plain aten::bmm would be read as dense GEMM by explain=true
# (report/explain/categories.py tells expert GEMMs by a name with "grouped" or "expert" in
# it). Compiled graphs call it like any aten op (inductor does not look inside; it would not
# fuse a bmm either), and AOTAutograd's cache keeps graphs that hold it.


@torch.library.custom_op("moe_perf::expert_bmm", mutates_args=())
def expert_bmm(x_LJD: torch.Tensor, w_LDF: torch.Tensor) -> torch.Tensor:
    """x_LJD @ w_LDF, expert by expert."""
    return torch.bmm(x_LJD, w_LDF)


@expert_bmm.register_fake
def _(x_LJD, w_LDF):
    return x_LJD.new_empty(x_LJD.shape[0], x_LJD.shape[1], w_LDF.shape[2])


@torch.library.custom_op("moe_perf::expert_bmm_backward", mutates_args=())
def expert_bmm_backward(
    grad_LJF: torch.Tensor, x_LJD: torch.Tensor, w_LDF: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad x_LJD, grad w_LDF) of expert_bmm."""
    return torch.bmm(grad_LJF, w_LDF.transpose(1, 2)), torch.bmm(x_LJD.transpose(1, 2), grad_LJF)


@expert_bmm_backward.register_fake
def _(grad_LJF, x_LJD, w_LDF):
    return torch.empty_like(x_LJD), torch.empty_like(w_LDF)


def _expert_bmm_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _expert_bmm_grad(ctx, grad_LJF):
    return expert_bmm_backward(grad_LJF, *ctx.saved_tensors)


expert_bmm.register_autograd(_expert_bmm_grad, setup_context=_expert_bmm_setup)


def _grouped_mm_ok(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """torch._grouped_mm needs row strides that are multiples of 16 bytes; bf16 on CUDA, and
    under torch.compile on any device (its meta kernel, which dynamo traces with, refuses other
    dtypes although the CPU kernel runs them)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.dtype != torch.bfloat16 and (x.is_cuda or torch.compiler.is_compiling()):
        return False
    return all(
        (t.shape[-1] * t.element_size()) % 16 == 0 and (t.shape[-2] * t.element_size()) % 16 == 0
        for t in (x, *weights)
    )


class GroupedExperts(nn.Module):
    """L SwiGLU experts as stacked weights: w13 [L, D, 2F] (the gate projection w1 in
    [..., :F], the up projection w3 in [..., F:]), w2 [L, F, D].

    One weight for w1 and w3: their matmuls read the same rows, so one matmul of width 2F does
    both (wider tiles than two of width F), and its backward is one matmul for the input's
    gradient (a reduction over 2F) instead of two whose outputs are then added.

    forward(x_ND, tokens_per_expert_L): rows of x_ND are grouped by expert in order 0..L-1.
    EP keeps rank r's slice [r*E/ep, (r+1)*E/ep) of every weight, sets num_experts to L and
    first_expert (the global id of local expert 0) to r*E/ep.
    """

    def __init__(self, num_experts: int, dim: int, ffn: int, swiglu_clamp: float = 0.0):
        super().__init__()
        self.num_experts = num_experts
        self.ffn = ffn
        self.first_expert = 0
        self.swiglu_clamp = swiglu_clamp
        # auto: bmm where every expert has the same count, else _grouped_mm where it runs, else
        # loop | grouped_mm | loop
        self.backend = "auto"
        self.w13 = nn.Parameter(torch.empty(num_experts, dim, 2 * ffn))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn, dim))

    def init_weights(self, std: float, out_std: float, generator=None) -> None:
        """Truncated normal weights.

        With `generator` (the model's per-unit init, model.Transformer.init_weights) expert e
        of each weight (w1, w3 and w2; w1 and w3 are halves of w13) draws from its own stream,
        seeded from (the generator's seed, weight name, GLOBAL expert id first_expert + e), and
        nothing from `generator` itself: an EP rank that holds only experts [first, first + L)
        initialises exactly their slice of the full layer, without ever allocating the full
        layer. Without, the global RNG fills whole tensors.
        """
        F = self.ffn
        views = {"w1": self.w13[..., :F], "w3": self.w13[..., F:], "w2": self.w2}
        for name, s in (("w1", std), ("w3", std), ("w2", out_std)):
            w = views[name]
            if generator is None:
                value = torch.empty(w.shape, dtype=w.dtype, device=w.device)
                with torch.no_grad():
                    w.copy_(nn.init.trunc_normal_(value, std=s))
                continue
            unit = generator.initial_seed()
            for e in range(w.shape[0]):
                g = init_generator(w.device, unit, name, self.first_expert + e)
                # drawn contiguous, then copied into the (strided) half of w13
                value = torch.empty(w.shape[1:], dtype=w.dtype, device=w.device)
                nn.init.trunc_normal_(value, std=s, generator=g)
                with torch.no_grad():
                    w[e].copy_(value)

    def forward(
        self, x_ND: torch.Tensor, tokens_per_expert_L: torch.Tensor, equal_counts: bool = False
    ) -> torch.Tensor:
        """`equal_counts`: the caller knows every expert has N/L rows (forced balance's
        round-robin dispatch): then `auto` runs one batched matmul per weight (`_bmm`)."""
        w13, w2 = self.w13, self.w2
        if torch.is_autocast_enabled(x_ND.device.type):
            # _grouped_mm has no autocast rule: cast by hand to the autocast dtype.
            dt = torch.get_autocast_dtype(x_ND.device.type)
            x_ND, w13, w2 = x_ND.to(dt), w13.to(dt), w2.to(dt)
        if self.backend == "auto" and equal_counts:
            return self._bmm(x_ND, w13, w2)
        use_grouped = self.backend == "grouped_mm" or (
            self.backend == "auto" and _grouped_mm_ok(x_ND, w13, w2)
        )
        if use_grouped:
            # Rows past offsets[-1] come back uninitialised; there are none here (N = sum).
            # cumsum then a cast, not cumsum(dtype=int32): inductor (torch 2.13) returns int64
            # for cumsum(dtype=int32) of a constant (the round-robin dispatch's counts)
            offsets_L = torch.cumsum(tokens_per_expert_L, 0).to(torch.int32)
            h_NF = self._swiglu(torch._grouped_mm(x_ND, w13, offs=offsets_L))
            return torch._grouped_mm(h_NF, w2, offs=offsets_L)
        return self._loop(x_ND, tokens_per_expert_L, w13, w2)

    def _swiglu(self, h13: torch.Tensor) -> torch.Tensor:
        """SwiGLU of the w13 product: silu(gate half) * up half."""
        F = self.ffn
        return swiglu(h13[..., :F], h13[..., F:], self.swiglu_clamp)

    def _bmm(self, x_ND, w13, w2) -> torch.Tensor:
        """Equal counts: the rows are L blocks of N/L, so each weight is one batched matmul
        [L, N/L, D] @ [L, D, F], the same products as grouped_mm. cuBLAS's strided batches beat
        the grouped kernel on one H200: +2.6% (4 layers) and +2.7% (8 layers) on the whole
        qwen3-30b-a3b step, expert GEMMs about 17 ms a step less at 4 layers."""
        L = w13.shape[0]
        x_LJD = x_ND.view(L, -1, x_ND.shape[-1])
        h_LJF = self._swiglu(expert_bmm(x_LJD, w13))
        return expert_bmm(h_LJF, w2).view(x_ND.shape[0], -1)

    def _loop(self, x_ND, tokens_per_expert_L, w13, w2) -> torch.Tensor:
        """Per-expert matmuls on slices (a host sync for the counts)."""
        outs, start = [], 0
        for e, n in enumerate(tokens_per_expert_L.tolist()):
            x = x_ND[start : start + n]
            outs.append(self._swiglu(x @ w13[e]) @ w2[e])
            start += n
        return torch.cat(outs) if outs else x_ND.new_zeros(0, w2.shape[-1])
