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

import torch
from torch import nn


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
            master.grad = p.grad.to(torch.float32)
        else:
            master.grad.add_(p.grad)
        p.grad = None

    return hook


def master_weights(module: nn.Module) -> MasterWeights | None:
    return getattr(module, "master_weights", None)


def optimizer_params(module: nn.Module) -> list[nn.Parameter]:
    """What the optimizer trains for a model part: its fp32 masters where it has them, its
    own parameters otherwise."""
    mw = master_weights(module)
    params = mw.masters if mw is not None else list(module.parameters())
    return [p for p in params if p.requires_grad]
