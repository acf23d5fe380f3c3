"""prebuild.py: the helper process compiles the Triton launches of a step ahead, and the step's
own launches find them in Triton's cache. On the CPU for an H100's target (Triton's own binder
computes each launch's cache key from the step's real tensors); on a GPU the real launches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from moe_perf.trainer import loss, prebuild, precision

pytest.importorskip("triton")
HERE = Path(__file__).resolve().parent
H100 = ("cuda", 90, 32)  # Triton's target: backend, architecture, warp size
VOCAB = 1000


def small(device: str = "cpu"):
    """A bf16 model over fp32 masters and its MasterAdamW, as the trainer builds them: the
    masters of a kept fp32 embedding and of two Linears (sizes not all divisible by 16)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 64), nn.Linear(64, 4097), nn.Linear(4097, VOCAB))
    model = model.to(device)
    mw = precision.MasterWeights(model, torch.bfloat16, keep_fp32=(model[0],))
    return model, mw, precision.MasterAdamW(mw.masters, [mw], lr=1e-2)


def step_launches(opt: precision.MasterAdamW) -> list[prebuild.Launch]:
    """What a step of `small` launches: the loss, then over 2 micro-batches the gradients' cast
    and accumulation, and AdamW with the clip's scale."""
    return loss.prebuild_launches(VOCAB, torch.bfloat16) + opt.prebuild_launches(True, 2)


def cpu_step_launches() -> list[prebuild.Launch]:
    _, _, opt = small()
    opt._triton = True  # the step's decision on a GPU (on the CPU torch's AdamW runs)
    return step_launches(opt)


def compile_ahead(launches, target, cache: Path) -> subprocess.Popen:
    os.environ["TRITON_CACHE_DIR"] = str(cache)  # the helper inherits the trainer's environment
    try:
        return prebuild.start(launches, target)
    finally:
        del os.environ["TRITON_CACHE_DIR"]


def run_python(code: str, cache: Path) -> dict:
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "PYTHONPATH": path}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            timeout=300, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# Each launch again with fresh CPU tensors where the helper had stand-ins, through Triton's
# binder for the same target (compiling, not launching), then the loss's forward with its lse
# 4 bytes off alignment: Triton's listener (runtime.triton_compiles) counts what was compiled
# and what was loaded from the cache.
LAUNCH_ON_CPU = """
import json, torch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
import test_prebuild
from moe_perf.trainer import kernels, prebuild, runtime

def real(a):
    return torch.zeros(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) and a.is_meta else a

launches = test_prebuild.cpu_step_launches()
runtime.triton_compiles.install()
driver.set_active(prebuild._CompileOnly(GPUTarget(*test_prebuild.H100)))
for launch in launches:
    args = [real(a) for a in launch.args]
    getattr(kernels, launch.kernel).warmup(*args, grid=(1,), **launch.constexprs)
seen = runtime.triton_compiles.summary()
forward = launches[0]
args = [real(a) for a in forward.args]
args[2] = torch.zeros(2)[1:]  # lse, 4 bytes off
kernels.cross_entropy_forward_kernel.warmup(*args, grid=(1,), **forward.constexprs)
print(json.dumps({"step": seen, "unaligned": runtime.triton_compiles.summary()}))
"""


@pytest.mark.slow
def test_a_steps_launches_find_what_the_helper_compiled_and_an_unforeseen_one_compiles(tmp_path):
    cache = tmp_path / "triton"
    launches = cpu_step_launches()
    names = {launch.kernel for launch in launches}
    assert names == {"cross_entropy_forward_kernel", "cross_entropy_backward_kernel",
                     "grad_add_kernel", "master_adamw_kernel"}  # fmt: skip
    helper = compile_ahead(launches, H100, cache)
    assert helper.wait(timeout=300) == 0
    compiled = list(cache.glob("*/*.cubin"))
    assert {p.stem for p in compiled} == names
    counts = run_python(LAUNCH_ON_CPU, cache)
    assert counts["step"]["compiled"] == 0, counts
    # one per variant: the loss's two, grad_add with and without ADD, AdamW with and without a
    # copy, each over sizes divisible by 16 and not: 9
    assert counts["step"]["loaded_from_cache"] == len(compiled) == 9
    assert counts["unaligned"]["compiled"] == 1  # an address Triton specializes on counts


def test_describe_gives_what_triton_specializes_on():
    x = torch.zeros(4, dtype=torch.bfloat16)
    assert prebuild.describe(x) == {"dtype": "bfloat16", "aligned": True}
    assert prebuild.describe(torch.zeros(8)[1:]) == {"dtype": "float32", "aligned": False}
    assert prebuild.describe(torch.empty(3, device="meta")) == {"dtype": "float32", "aligned": True}
    assert [prebuild.describe(a) for a in (4097, -100, 0.9, True)] == [4097, -100, 0.9, True]


@pytest.mark.slow
def test_a_launch_the_helper_cannot_compile_is_named_and_the_others_compile(tmp_path):
    cache = tmp_path / "triton"
    launches = loss.prebuild_launches(VOCAB, torch.bfloat16)
    broken = prebuild.Launch("no_such_kernel", launches[0].args, launches[0].constexprs)
    os.environ["TRITON_CACHE_DIR"] = str(cache)
    try:
        helper = subprocess.Popen(
            [sys.executable, "-m", "moe_perf.trainer.prebuild"],
            stdin=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        del os.environ["TRITON_CACHE_DIR"]
    request = {"target": list(H100), "launches": [x.record() for x in [broken, *launches]]}
    _, err = helper.communicate(json.dumps(request), timeout=300)
    assert helper.returncode == 1
    assert err.strip().splitlines()[-1].startswith("moe_perf.trainer.prebuild: no_such_kernel:")
    assert {p.stem for p in cache.glob("*/*.cubin")} == {
        "cross_entropy_forward_kernel", "cross_entropy_backward_kernel"}  # fmt: skip


def test_nothing_to_compile_starts_no_helper():
    assert prebuild.start([], H100) is None
    prebuild.stop(None)


GPU_STEP = """
import json, torch
from triton.runtime.driver import driver
import test_prebuild
from moe_perf.trainer import loss, prebuild, runtime

model, mw, opt = test_prebuild.small("cuda")
assert opt._one_pass()
target = driver.active.get_current_target()
helper = prebuild.start(test_prebuild.step_launches(opt), (target.backend, target.arch, 32))
assert helper.wait() == 0
runtime.triton_compiles.install()
tokens = torch.randint(0, 50, (2, 8), device="cuda")
labels = torch.randint(0, test_prebuild.VOCAB, (2, 8), device="cuda")
for _ in range(2):
    with torch.autocast("cuda", torch.bfloat16):
        logits = model(tokens)
    (loss.triton_cross_entropy(logits, labels, in_place=True) / 2).backward()
opt.grad_scale = torch.tensor(2.0, device="cuda")
opt.step()
torch.cuda.synchronize()
print(json.dumps(runtime.triton_compiles.summary()))
"""


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_a_steps_launches_load_what_the_helper_compiled(tmp_path):
    counts = run_python(GPU_STEP, tmp_path / "triton")
    assert counts["compiled"] == 0, counts
    assert counts["loaded_from_cache"] >= 6


@pytest.mark.slow
def test_triton_key_is_hashed_by_a_thread_before_the_first_compile_needs_it():
    """runtime.hash_triton_in_background: a thread fills Triton's lru-cached version key, so
    the first compile's cache keys (inductor's, AOTAutograd's) find it instead of hashing
    libtriton.so on the main thread. A fresh process: the key is not yet cached there."""
    code = (
        "import threading\n"
        "from torch._inductor.runtime.triton_compat import triton_key\n"
        "from moe_perf.trainer.runtime import hash_triton_in_background\n"
        "assert triton_key.cache_info().currsize == 0\n"
        "thread = hash_triton_in_background()\n"
        "assert thread is not threading.current_thread()\n"
        "thread.join()\n"
        "assert triton_key.cache_info().misses == 1\n"
        "key = triton_key()\n"
        "assert triton_key.cache_info().hits == 1 and key\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=HERE.parent, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
