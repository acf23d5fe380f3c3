"""bf16 compute weights over fp32 master weights, for a model part outside FSDP.

With more than one data x context rank, FSDP's mixed precision gives each layer bf16 weights
for compute and keeps the fp32 shards for the optimizer. On one such rank there is no FSDP
(parallelize.py), and autocast alone would cast every fp32 weight to bf16 again in every
micro-batch (inside the compiled blocks, often twice: the backward recomputes the cast), add
each micro-batch's gradient to the fp32 one in two passes (a cast, then an add), and run the
residual stream in fp32. `MasterWeights` does on one rank what FSDP does on many:

* the module's parameters become bf16 (the copies compute reads), once per step: after the
  optimizer step, the fp32 masters are copied into them (`copy_to_model`, inside the timed
  step);
* the optimizer and the gradient clipping see the fp32 masters (`masters`);
* each micro-batch's bf16 gradient (what autocast's bf16 GEMMs produce too) is added into the
  master's fp32 gradient by a hook as soon as autograd has it, and the bf16 one is dropped:
  the accumulation stays in fp32, as it was;
* the token embedding stays fp32 (its lookup reads a few rows; its gradient is a sum over
  every token of the micro-batch) and its output is cast to bf16: the residual stream is
  bf16, as under FSDP's mixed precision.

Numerics against autocast over fp32 weights: the GEMMs see the same bf16 weights and produce
the same bf16 gradients; the residual stream and the norms' inputs are bf16 instead of fp32.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
from torch import nn

from moe_perf.trainer.prebuild import Launch


class MasterWeights:
    """fp32 masters of `module`'s parameters (all but those of `keep_fp32`), whose own
    parameters become `dtype` copies. The module keeps its parameter objects (compiled code
    and hooks see the same tensors); only their dtype changes."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, keep_fp32: tuple = ()):
        kept = {id(p) for m in keep_fp32 if m is not None for p in m.parameters()}
        self.dtype = dtype
        self.compute: list[nn.Parameter] = []
        self.masters: list[nn.Parameter] = []  # what the optimizer trains
        self.compute_masters: list[nn.Parameter] = []  # the master of each of `compute`
        for p in module.parameters():
            if id(p) in kept or not p.requires_grad or p.dtype != torch.float32:
                self.masters.append(p)  # trained as it is
                continue
            master = nn.Parameter(p.detach().clone())
            with torch.no_grad():
                p.data = p.data.to(dtype)
            p.register_post_accumulate_grad_hook(_accumulate_into(master))
            self.compute.append(p)
            self.masters.append(master)
            self.compute_masters.append(master)
        for m in keep_fp32:
            if m is not None:
                m.register_forward_hook(self._cast_output)

    def _cast_output(self, _module, _inputs, output: torch.Tensor) -> torch.Tensor:
        return output.to(self.dtype)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """The masters' values into the compute copies (after each optimizer step)."""
        if self.compute:
            torch._foreach_copy_(self.compute, self.compute_masters)


def _accumulate_into(master: nn.Parameter):
    """Hook of a compute parameter: its bf16 gradient added into `master.grad` in fp32 (one
    pass; the first micro-batch's is a cast), then dropped."""

    def hook(p: torch.Tensor) -> None:
        if master.grad is None:
            master.grad = cast_fp32(p.grad)
        else:
            accumulate_(master.grad, p.grad)
        p.grad = None

    return hook


# --------------------------------------------------------------------------------------------
# fp32 += bf16 at the memory's speed
#
# ATen never vectorizes an elementwise op whose operands differ in dtype (TensorIterator takes
# its "dynamic casting" path, one element per load): on one H200 `fp32.add_(bf16)` moved about
# 2.6 TB/s, and the accumulation of 4 micro-batches' expert gradients took 62 of the 8-layer
# bench's 840 ms a step. On CUDA a Triton kernel does the same arithmetic (fp32(g) added in
# fp32, one rounding: bit-identical to ATen's) with wide loads.

_BLOCK = 4096


@functools.cache
def triton_kernels() -> ModuleType | None:
    """kernels.py (the trainer's own Triton kernels), or None where Triton is missing."""
    try:
        from moe_perf.trainer import kernels
    except ImportError:
        return None
    return kernels


def launch(what: Launch, grid: tuple) -> None:
    """`what`, one of kernels.py's kernels, launched over `grid` on the current device."""
    getattr(triton_kernels(), what.kernel)[grid](*what.args, **what.constexprs)


def _triton_reads(g: torch.Tensor) -> bool:
    """Whether the Triton kernels take `g` (a bf16 or fp16 gradient on CUDA, contiguous)."""
    return (
        g.is_cuda
        and g.dtype in (torch.bfloat16, torch.float16)
        and g.is_contiguous()
        and triton_kernels() is not None
    )


def _grad_add_launch(acc: torch.Tensor, g: torch.Tensor, add: bool) -> Launch:
    return Launch("grad_add_kernel", (acc, g, g.numel()), dict(ADD=add, BLOCK=_BLOCK, num_warps=8))


def _launch(acc: torch.Tensor, g: torch.Tensor, add: bool) -> None:
    with torch.cuda.device(g.device):
        launch(_grad_add_launch(acc, g, add), grid=(-(-g.numel() // _BLOCK),))


def accumulate_(acc: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """acc += g in place, acc fp32 and g bf16 (or anything `add_` takes)."""
    fp32 = acc.dtype == torch.float32 and acc.is_contiguous() and acc.shape == g.shape
    if fp32 and _triton_reads(g):
        _launch(acc, g, add=True)
        return acc
    return acc.add_(g)


def cast_fp32(g: torch.Tensor) -> torch.Tensor:
    """g as a new fp32 tensor (the first micro-batch's gradient)."""
    if not _triton_reads(g):
        return g.to(torch.float32)
    out = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    _launch(out, g, add=False)
    return out


def master_weights(module: nn.Module) -> MasterWeights | None:
    return getattr(module, "master_weights", None)


def optimizer_params(module: nn.Module) -> list[nn.Parameter]:
    """What the optimizer trains for a model part: its fp32 masters where it has them, its
    own parameters otherwise."""
    mw = master_weights(module)
    params = mw.masters if mw is not None else list(module.parameters())
    return [p for p in params if p.requires_grad]


# --------------------------------------------------------------------------------------------
# The optimizer step and the copies in one pass


class MasterAdamW(torch.optim.AdamW):
    """AdamW over fp32 masters that also writes each master's compute copy.

    torch's fused AdamW reads and writes the masters and their two moments (28 B per parameter),
    then `copy_to_model` reads every master again to write its bf16 copy (6 B more). On CUDA one
    Triton kernel per parameter does both (30 B), with the same arithmetic in fp32 as torch's
    (decoupled weight decay, bias corrections, the clip as a `grad_scale` divisor). Elsewhere
    (CPU, no Triton, a non-contiguous tensor) torch's fused AdamW runs, then the copies.
    The state (`step` on the host, `exp_avg`, `exp_avg_sq`) is torch's AdamW's.
    """

    def __init__(self, params, master_weights: list[MasterWeights], **kwargs):
        super().__init__(params, fused=True, **kwargs)
        self._triton: bool | None = None
        self.master_weights = master_weights
        self.copy_of = {
            id(master): p for mw in master_weights
            for p, master in zip(mw.compute, mw.compute_masters, strict=True)
        }  # fmt: skip

    def _one_pass(self) -> bool:
        """Whether the Triton step applies (decided at the first step: parameters keep their
        device and layout)."""
        if self._triton is None:
            params = [p for group in self.param_groups for p in group["params"]]
            self._triton = (
                bool(params)
                and all(p.is_cuda and p.is_contiguous() for p in params)
                and (triton_kernels() is not None)
            )
        return self._triton

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterAdamW.step takes no closure")
        if not self._one_pass():
            super().step()
            for mw in self.master_weights:
                mw.copy_to_model()
            return None
        scale = getattr(self, "grad_scale", None)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_one(p, group, scale)
        return None

    def _step_one(self, p: torch.Tensor, group: dict, scale: torch.Tensor | None) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)  # on the host: no launch, no sync
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        what = self._launch(p, p.grad, state["exp_avg"], state["exp_avg_sq"], group, scale,
                            step=float(state["step"]))  # fmt: skip
        with torch.cuda.device(p.device):
            launch(what, grid=(-(-p.numel() // _BLOCK),))

    def _launch(self, p, grad, exp_avg, exp_avg_sq, group, scale, step: float) -> Launch:
        lr, (beta1, beta2) = float(group["lr"]), group["betas"]
        copy = self.copy_of.get(id(p))
        return Launch(
            "master_adamw_kernel",
            (p, grad, exp_avg, exp_avg_sq, copy if copy is not None else p,
             scale if scale is not None else p, p.numel(), lr, beta1, beta2, group["eps"],
             group["weight_decay"], lr / (1 - beta1**step), (1 - beta2**step) ** 0.5),
            dict(HAS_SCALE=scale is not None, HAS_COPY=copy is not None, BLOCK=_BLOCK,
                 num_warps=8),
        )  # fmt: skip

    def prebuild_launches(self, clip: bool, micro_batches: int) -> list[Launch]:
        """The launches of the Triton passes in a step (none where torch's AdamW runs), for
        prebuild.py: each master's AdamW step (`clip`: with the clip's scale) and each compute
        copy's gradient cast and, over several `micro_batches`, accumulation. Meta tensors
        stand for the step's fresh allocations (gradients, moments, the scale)."""
        if not self._one_pass():
            return []

        def fresh(p: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
            return torch.empty(p.shape, dtype=dtype, device="meta")

        scale = torch.empty(1, device="meta") if clip else None
        launches = [
            self._launch(p, fresh(p), fresh(p), fresh(p), group, scale, step=1.0)
            for group in self.param_groups
            for p in group["params"]
        ]
        adds = (False, True)[:micro_batches]  # the first micro-batch's gradient is a cast
        for mw in self.master_weights:
            for p in mw.compute:
                if p.dtype in (torch.bfloat16, torch.float16):  # as _triton_reads
                    acc, g = fresh(p), fresh(p, p.dtype)
                    launches += [_grad_add_launch(acc, g, add) for add in adds]
        return launches
