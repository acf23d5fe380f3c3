"""What the first calls of a process cost on this GPU: cuBLAS's mm and causal GQA attention
through cuDNN and through torch's flash kernels, forward and backward, then the same again.

    python bench/bench_first_calls.py                 # qwen3-30b-a3b's attention, micro-batch 8
    python bench/bench_first_calls.py --side-thread   # cuDNN used first by another thread

Run each variant in a fresh process (the point is a process's first use). --side-thread runs
one mm and one cuDNN attention in another Python thread first, as the trainer's warm-up thread
does, to split a first use's cost into the process's share and the calling thread's (cuDNN
keeps its built graphs per thread; a backward always runs on autograd's device thread). Last,
the steady forward-and-backward time of each attention backend over 10 calls.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0)


def attention(args, backend: SDPBackend, label: str) -> None:
    def bf16(heads):
        shape = (args.batch, heads, args.seq, args.head_dim)
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    q, k, v = bf16(args.heads), bf16(args.kv_heads), bf16(args.kv_heads)
    out = []
    with sdpa_kernel([backend]):
        fwd = timed(lambda: out.append(F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=args.heads != args.kv_heads)))  # fmt: skip
    bwd = timed(lambda: out[0].sum().backward())
    print(f"{label:42s} forward {fwd:8.1f} ms   backward {bwd:8.1f} ms", flush=True)


def mm(args, label: str) -> None:
    a = torch.randn(args.batch * args.seq, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    print(f"{label:42s} {timed(lambda: a @ b):8.1f} ms", flush=True)


def steady(args, backend: SDPBackend, label: str, n: int = 10) -> None:
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv_shape = (args.batch, args.kv_heads, args.seq, args.head_dim)
    k, v = (torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))  # fmt: skip

    def calls():
        with sdpa_kernel([backend]):
            for _ in range(n):
                F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=args.heads != args.kv_heads
                ).sum().backward()

    print(f"{label:42s} {timed(calls) / n:8.2f} ms a forward and backward")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--side-thread", action="store_true")
    args = p.parse_args()
    torch.zeros(1, device="cuda")  # the CUDA context, outside every figure
    if args.side_thread:

        def first():
            mm(args, "mm, side thread, first")
            attention(args, SDPBackend.CUDNN_ATTENTION, "cuDNN attention, side thread, first")

        side = threading.Thread(target=first)
        side.start()
        side.join()
    mm(args, "mm, main thread")
    mm(args, "mm, main thread, again")
    attention(args, SDPBackend.CUDNN_ATTENTION, "cuDNN attention, main thread")
    attention(args, SDPBackend.CUDNN_ATTENTION, "cuDNN attention, main thread, again")
    attention(args, SDPBackend.FLASH_ATTENTION, "flash attention, main thread")
    attention(args, SDPBackend.FLASH_ATTENTION, "flash attention, main thread, again")
    steady(args, SDPBackend.CUDNN_ATTENTION, "cuDNN attention, steady")
    steady(args, SDPBackend.FLASH_ATTENTION, "flash attention, steady")


if __name__ == "__main__":
    main()
