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

import torch

from moe_perf.trainer.model import cross_entropy
from moe_perf.trainer.prebuild import Launch
from moe_perf.trainer.precision import launch, triton_kernels

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index
_BLOCK = 4096


def cross_entropy_fn(device: torch.device, compile: bool) -> Callable:
    """The trainer's loss function on `device`: the Triton passes on CUDA where Triton imports
    (the logits' gradient written over them), else `cross_entropy` (compiled if `compile`)."""
    if device.type == "cuda" and triton_kernels() is not None:
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
        T = logits_TV.shape[0]
        lse_T = torch.empty(T, dtype=torch.float32, device=logits_TV.device)
        loss_T = torch.empty_like(lse_T)
        with _on(logits_TV.device):
            launch(_forward_launch(logits_TV, labels_T, lse_T, loss_T), grid=(T,))
        counted = (labels_T != IGNORE_INDEX).sum()
        ctx.save_for_backward(logits_TV, labels_T, lse_T, counted)
        ctx.in_place = in_place
        return loss_T.sum() / counted  # 0/0 = nan when no token counts, as F.cross_entropy

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits_TV, labels_T, lse_T, counted = ctx.saved_tensors
        T = logits_TV.shape[0]
        scale = (grad_loss.float() / counted).reshape(1)
        grad_TV = logits_TV if ctx.in_place else torch.empty_like(logits_TV)
        with _on(logits_TV.device):
            launch(_backward_launch(logits_TV, grad_TV, labels_T, lse_T, scale), grid=(T,))
        return grad_TV, None, None


def _on(device: torch.device):
    """The device Triton launches on (CUDA); nothing to select for Triton's CPU interpreter."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def _forward_launch(logits_TV, labels_T, lse_T, loss_T) -> Launch:
    return Launch(
        "cross_entropy_forward_kernel",
        (logits_TV, labels_T, lse_T, loss_T, logits_TV.stride(0), IGNORE_INDEX),
        dict(V=logits_TV.shape[1], BLOCK=_BLOCK, num_warps=8),
    )


def _backward_launch(logits_TV, grad_TV, labels_T, lse_T, scale) -> Launch:
    return Launch(
        "cross_entropy_backward_kernel",
        (logits_TV, grad_TV, labels_T, lse_T, scale, logits_TV.stride(0), grad_TV.stride(0),
         IGNORE_INDEX),
        dict(V=logits_TV.shape[1], BLOCK=_BLOCK, num_warps=8),
    )  # fmt: skip


def prebuild_launches(vocab: int, dtype: torch.dtype) -> list[Launch]:
    """The launches of the Triton loss over [tokens x `vocab`] logits of `dtype` (contiguous,
    gradient in place, as the trainer calls it), for prebuild.py; meta tensors stand for the
    step's fresh allocations."""
    meta = dict(device="meta")
    logits_TV = torch.empty(1, vocab, dtype=dtype, **meta)
    labels_T = torch.empty(1, dtype=torch.int64, **meta)
    lse_T, loss_T, scale = (torch.empty(1, dtype=torch.float32, **meta) for _ in range(3))
    return [
        _forward_launch(logits_TV, labels_T, lse_T, loss_T),
        _backward_launch(logits_TV, logits_TV, labels_T, lse_T, scale),
    ]
