"""The train step's token cross-entropy, and on CUDA its two Triton passes.

The loss reads the head's logits, [tokens x vocab] in bf16 (5 GB a micro-batch of 8 x 2048
tokens at qwen3-30b-a3b's 151,936 words). Compiled, inductor's forward and backward over them
took 25.4 ms of the 8-layer bench's 840 ms step on one H200, about twice what reading them once
forward and once backward (writing the gradient) costs. On CUDA `cross_entropy_fn` gives instead:

* forward, one Triton program per token: one pass over its row keeps a running maximum and a
  running sum of exponentials (the online softmax), so the row is read once; it writes the
  row's log-sum-exp and loss;
* backward, one pass per row: softmax(x) - onehot(label), times the incoming gradient over the
  count of counted tokens, read from the device (no host sync), written in bf16 over the logits
  themselves (`in_place`: nothing else reads them after the loss, so no second 5 GB buffer).

On one H100 (4 layers, micro-batch 8) inductor's pair took 28.4 ms a step, these 23.4 (forward 9.7,
backward 13.8: about 2.1 and 2.9 TB/s, short of the card's 3.35).

The arithmetic is in fp32, as `F.cross_entropy(logits.float(), labels)` does it; labels equal to
-100 are not counted (its `ignore_index`). Elsewhere `cross_entropy_fn` gives that call itself
(model.cross_entropy), compiled where the trainer compiles.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from types import SimpleNamespace

import torch

from moe_perf.trainer.model import cross_entropy
from moe_perf.trainer.precision import TritonKernels

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index
_BLOCK = 4096


def cross_entropy_fn(device: torch.device, compile: bool) -> Callable:
    """The trainer's loss function on `device`: the Triton passes on CUDA where Triton imports
    (the logits' gradient written over them), else `cross_entropy` (compiled if `compile`)."""
    if device.type == "cuda" and _kernels() is not None:
        return lambda logits_BSV, labels_BS: triton_cross_entropy(logits_BSV, labels_BS, True)
    return torch.compile(cross_entropy) if compile else cross_entropy


def triton_cross_entropy(
    logits_BSV: torch.Tensor, labels_BS: torch.Tensor, in_place: bool = False
) -> torch.Tensor:
    """`cross_entropy` by the Triton passes (CUDA). `in_place`: the backward writes the logits'
    gradient over the logits (they must not be read after the loss)."""
    V = logits_BSV.shape[-1]
    return _CrossEntropy.apply(logits_BSV.reshape(-1, V), labels_BS.reshape(-1), in_place)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TV: torch.Tensor, labels_T: torch.Tensor, in_place: bool):
        if logits_TV.stride(-1) != 1:
            logits_TV = logits_TV.contiguous()
        T, V = logits_TV.shape
        lse_T = torch.empty(T, dtype=torch.float32, device=logits_TV.device)
        loss_T = torch.empty_like(lse_T)
        with _on(logits_TV.device):
            _kernels().forward[(T,)](
                logits_TV, labels_T, lse_T, loss_T, logits_TV.stride(0), IGNORE_INDEX,
                V=V, BLOCK=_BLOCK, num_warps=8,
            )  # fmt: skip
        counted = (labels_T != IGNORE_INDEX).sum()
        ctx.save_for_backward(logits_TV, labels_T, lse_T, counted)
        ctx.in_place = in_place
        return loss_T.sum() / counted  # 0/0 = nan when no token counts, as F.cross_entropy

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits_TV, labels_T, lse_T, counted = ctx.saved_tensors
        T, V = logits_TV.shape
        scale = (grad_loss.float() / counted).reshape(1)
        grad_TV = logits_TV if ctx.in_place else torch.empty_like(logits_TV)
        with _on(logits_TV.device):
            _kernels().backward[(T,)](
                logits_TV, grad_TV, labels_T, lse_T, scale, logits_TV.stride(0),
                grad_TV.stride(0), IGNORE_INDEX, V=V, BLOCK=_BLOCK, num_warps=8,
            )  # fmt: skip
        return grad_TV, None, None


def _on(device: torch.device):
    """The device Triton launches on (CUDA); nothing to select for Triton's CPU interpreter."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def _build_kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    @triton.jit
    def cross_entropy_forward_kernel(logits_ptr, labels_ptr, lse_ptr, loss_ptr, stride, ignore,
                                     V: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        # per lane: the running maximum and the sum of exp(x - maximum) of what it has read
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            seen = m_new > float("-inf")  # a lane that has read only padding stays at 0
            s = tl.where(seen, s * tl.exp(m - m_new) + tl.exp(x - m_new), 0.0)
            m = m_new
        row_max = tl.max(m, 0)
        total = tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - row_max), 0.0), 0)
        lse = row_max + tl.log(total)
        label = tl.load(labels_ptr + row)
        counted = label != ignore
        x_label = tl.load(base + tl.where(counted, label, 0)).to(tl.float32)
        tl.store(lse_ptr + row, lse)
        tl.store(loss_ptr + row, tl.where(counted, lse - x_label, 0.0))

    @triton.jit
    def cross_entropy_backward_kernel(logits_ptr, grad_ptr, labels_ptr, lse_ptr, scale_ptr, stride,
                                      grad_stride, ignore, V: tl.constexpr,
                                      BLOCK: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        lse = tl.load(lse_ptr + row)
        label = tl.load(labels_ptr + row)
        scale = tl.where(label != ignore, tl.load(scale_ptr), 0.0)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < V
            x = tl.load(logits_ptr + row * stride + offs, mask=mask).to(tl.float32)
            g = (tl.exp(x - lse) - tl.where(offs == label, 1.0, 0.0)) * scale
            tl.store(grad_ptr + row * grad_stride + offs,
                     g.to(grad_ptr.dtype.element_ty), mask=mask)  # fmt: skip

    return SimpleNamespace(forward=cross_entropy_forward_kernel,
                           backward=cross_entropy_backward_kernel)  # fmt: skip


_kernels = TritonKernels(_build_kernels)
