"""The Triton cross-entropy (trainer/loss.py) against F.cross_entropy: on the CPU through
Triton's interpreter (the same kernels, run element by element), on a GPU compiled."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_perf.trainer import loss

triton = pytest.importorskip("triton")
HERE = Path(__file__).resolve().parent


def against_torch(logits_BSV: torch.Tensor, labels_BS: torch.Tensor, in_place: bool):
    """(loss, gradient) of the Triton passes and of F.cross_entropy over fp32, for a
    backward of 0.25 x the loss (the 1/micro-batches the train step gives it)."""
    ref_in = logits_BSV.detach().clone().requires_grad_()
    ref = loss.cross_entropy(ref_in, labels_BS)
    (0.25 * ref).backward()
    x = logits_BSV.detach().clone().requires_grad_()
    logits = x * 1  # a non-leaf, as the head's output is: its buffer takes the gradient
    got = loss.triton_cross_entropy(logits, labels_BS, in_place=in_place)
    grads = {}
    logits.register_hook(lambda g: grads.setdefault("logits", g))
    (0.25 * got).backward()
    if in_place:
        assert grads["logits"].data_ptr() == logits.data_ptr(), "gradient not over the logits"
    return got, ref, x.grad, ref_in.grad


def interpreted_checks() -> None:
    """Run by the test below in a process where TRITON_INTERPRET=1 was set before Triton's
    first import (its own jit functions are then interpreted too)."""
    gen = torch.Generator().manual_seed(0)
    for dtype, vocab in itertools.product((torch.float32, torch.bfloat16), (300, 5000)):
        # under one block and a ragged last block; large logits: stability
        logits = (30 * torch.randn(2, 3, vocab, generator=gen)).to(dtype)
        labels = torch.randint(0, vocab, (2, 3), generator=gen)
        labels[0, 1] = loss.IGNORE_INDEX  # not counted
        labels[1, 2] = vocab - 1  # the last word, in the last block
        for in_place in (False, True):
            got, ref, grad, ref_grad = against_torch(logits, labels, in_place)
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
            assert grad.dtype == dtype
            assert not grad[0, 1].any(), "an ignored token got a gradient"
            # fp32 arithmetic in both; bf16 gradients may round one unit apart
            bf16 = dtype == torch.bfloat16
            tol = dict(rtol=0, atol=2**-9) if bf16 else dict(rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(grad, ref_grad, **tol)
    none_counted = torch.full((1, 2), loss.IGNORE_INDEX)
    assert loss.triton_cross_entropy(torch.randn(1, 2, 100), none_counted).isnan()  # as torch's
    print("interpreted checks passed")


@pytest.mark.slow
def test_interpreted_kernels_give_torchs_loss_and_gradient():
    code = "import test_loss; test_loss.interpreted_checks()"
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            timeout=300, check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "interpreted checks passed" in result.stdout


def test_off_cuda_the_trainer_keeps_torchs_cross_entropy():
    assert loss.cross_entropy_fn(torch.device("cpu"), compile=False) is loss.cross_entropy


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_kernels_give_torchs_loss_and_gradient_at_the_bench_vocabulary():
    torch.manual_seed(0)
    logits = (4 * torch.randn(2, 2048, 151936, device="cuda")).to(torch.bfloat16)
    labels = torch.randint(0, 151936, (2, 2048), device="cuda")
    labels[0, :7] = loss.IGNORE_INDEX
    got, ref, grad, ref_grad = against_torch(logits, labels, in_place=True)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # one bf16 unit of the largest gradient at most
    assert (grad.float() - ref_grad.float()).abs().max() <= 2**-8 * ref_grad.float().abs().max()


LISTENED = """
import json, sys, torch
from moe_perf.trainer import loss, runtime
runtime.triton_compiles.install()
logits = torch.randn(4, 8, 1000, device="cuda", requires_grad=True)
labels = torch.randint(0, 1000, (4, 8), device="cuda")
loss.triton_cross_entropy(logits * 1, labels, in_place=True).backward()
torch.cuda.synchronize()
print(json.dumps(runtime.triton_compiles.summary()))
"""


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_startup_counts_the_triton_kernels_the_trainer_compiles_and_those_it_loads(tmp_path):
    """startup.json's triton_in_process: a process with an empty Triton cache compiles the loss's
    two kernels (and says how long that took), the next one loads them."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    runs = []
    for _ in range(2):
        result = subprocess.run([sys.executable, "-c", LISTENED], env=env, capture_output=True,
                                text=True, timeout=300, check=False)  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert set(cold["kernels_s"]) == {"cross_entropy_forward_kernel",
                                      "cross_entropy_backward_kernel"}  # fmt: skip
    assert cold["compiled"] == 2 and cold["compile_s"] > 0
    assert warm["compiled"] == 0 and warm["loaded_from_cache"] >= 2
