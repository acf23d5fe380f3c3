"""The forced-balance dispatch of one MoE layer, sort-and-gather against the round-robin layout.

    python bench/bench_dispatch.py                    # GPU: qwen3-30b-a3b's layer, 16 x 2048 tokens
    python bench/bench_dispatch.py --tokens 4096 --hidden 256 --device cpu

What it times: dispatch, the combine's weighted sum over the K slots, and their backward, for
one micro-batch of a layer with forced balance on one EP rank (moe_perf/trainer/dispatch.py's
LocalDispatcher: `dispatch` sorts the slots by expert, `dispatch_round_robin` uses the layout
forced balance gives). The experts in between are left out (the same grouped GEMMs either
way), so the figure is the routing cost alone. Both variants run compiled (--eager: not), as
the trainer runs them with trainer.compile=true; their results are checked equal first
(to the dtype's rounding when compiled).
Median of --repeats timed calls after warm-up, with the device synchronized around each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moe_perf.trainer.dispatch import LocalDispatcher  # noqa: E402
from moe_perf.trainer.routing import forced_expert_ids  # noqa: E402


def make_step(d: LocalDispatcher, top_k: int, round_robin: bool):
    def step(x_TD: torch.Tensor, idx_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
        if round_robin:
            x_ND, _, state = d.dispatch_round_robin(x_TD, top_k)
        else:
            x_ND, _, state = d.dispatch(x_TD, idx_TK)
        y_TKD = d.combine(x_ND, state)  # the experts' place: identity
        return (y_TKD * w_TK.unsqueeze(-1)).sum(1)

    return step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_variant(step, x_TD, idx_TK, w_TK, grad_TD, warmup: int, repeats: int) -> float:
    device = x_TD.device
    times = []
    for i in range(warmup + repeats):
        x = x_TD.detach().requires_grad_()
        sync(device)
        t0 = time.perf_counter()
        step(x, idx_TK, w_TK).backward(grad_TD)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16 * 2048, help="tokens of the micro-batch")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--eager", action="store_true")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)

    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    T, D, E, K = args.tokens, args.hidden, args.experts, args.top_k
    torch.manual_seed(0)
    x_TD = torch.randn(T, D, device=device, dtype=dtype)
    grad_TD = torch.randn(T, D, device=device, dtype=dtype)
    w_TK = torch.rand(T, K, device=device, dtype=dtype)
    idx_TK = forced_expert_ids(0, T, K, E, 1, device)
    d = LocalDispatcher(E)

    steps = {}
    for name, rr in (("sort", False), ("round_robin", True)):
        step = make_step(d, K, rr)
        steps[name] = step if args.eager else torch.compile(step)
    ref, rr = (steps[n](x_TD, idx_TK, w_TK) for n in ("sort", "round_robin"))
    # the same rows in the same order; compiled, the weighted sum's fusion may round differently
    tol = {"rtol": 0, "atol": 0} if args.eager else {}
    torch.testing.assert_close(rr, ref, **tol)

    mode = "eager" if args.eager else "compiled"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"dispatch + combine, forward and backward: T={T} D={D} E={E} K={K} {args.dtype} "
          f"{mode} on {name}, torch {torch.__version__}, median of {args.repeats}")  # fmt: skip
    results = {}
    for n, step in steps.items():
        results[n] = time_variant(step, x_TD, idx_TK, w_TK, grad_TD, args.warmup, args.repeats)
        print(f"  {n:12s} {results[n] * 1e3:9.3f} ms")
    saved = results["sort"] - results["round_robin"]
    print(f"  saved        {saved * 1e3:9.3f} ms per layer and micro-batch "
          f"({saved / results['sort']:+.1%} of sort)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
