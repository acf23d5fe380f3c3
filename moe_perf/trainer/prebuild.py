"""The trainer's own Triton kernels compiled ahead, by a helper process, while step 1 traces.

A cold arm compiled them at their first launches in step 1, one after the other, on its critical
path (1.0-1.3 s on an H100: the loss's forward and backward, the gradient accumulation, the
AdamW step; kernels.py). Triton holds the GIL while it compiles, so a thread would slow dynamo's
trace by about what it saved; the trainer instead hands the launches its first step will make
(`Launch`) to a helper process (`start`): `python -m moe_perf.trainer.prebuild`, which compiles
each launch for the trainer's target (no CUDA context: it touches no device) into Triton's cache
directory, where the step's launches then find them. It starts after the model is built and is
done (about 3 s, torch's import included) before step 1's forward has compiled.

Triton's cache key is the kernel's source, the arguments' specialization (each tensor's dtype
and 16-byte alignment, each integer's value class: 1, divisible by 16, 32 or 64 bits) and the
options (num_warps, ...). The helper has Triton compute it as the launch does, from stand-ins
with the launch's dtypes, alignments and values, so a launch it did not foresee, or has not
finished compiling, compiles in the trainer as before: nothing depends on the helper.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Launch:
    """A launch of one of kernels.py's kernels: `kernel` its name there, `args` its positional
    arguments (tensors, or `describe`'s records of them), `constexprs` its keyword arguments."""

    kernel: str
    args: tuple
    constexprs: dict = field(default_factory=dict)

    def record(self) -> dict:
        return {"kernel": self.kernel, "args": [describe(a) for a in self.args],
                "constexprs": self.constexprs}  # fmt: skip


def describe(arg: Any) -> Any:
    """What Triton specializes a launch on, as JSON: a tensor's dtype and whether its address
    is 16-byte aligned (a meta tensor stands for a fresh allocation: aligned); any other
    argument as it is."""
    if hasattr(arg, "data_ptr") and hasattr(arg, "dtype"):
        return {"dtype": str(arg.dtype).removeprefix("torch."), "aligned": arg.data_ptr() % 16 == 0}
    return arg


def start(launches: list[Launch], target: tuple[str, int, int]) -> subprocess.Popen | None:
    """The helper, compiling `launches` for `target` (Triton's backend, architecture, warp
    size) into the Triton cache of this process's environment; None with nothing to compile."""
    records = {json.dumps(launch.record(), sort_keys=True) for launch in launches}
    if not records:
        return None
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_perf.trainer.prebuild"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    request = {"target": list(target), "launches": [json.loads(r) for r in sorted(records)]}
    proc.stdin.write(json.dumps(request))
    proc.stdin.close()
    return proc


def stop(proc: subprocess.Popen | None) -> None:
    """The helper stopped (if it is still compiling) and reaped."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.kill()
    proc.wait()


# --------------------------------------------------------------------------------------------
# The helper process


class _Stub:
    """A tensor argument as Triton's binder reads it: its dtype (a name Triton maps as it maps
    torch's, from the text after the last dot) and its address (0 or 8: aligned or not)."""

    def __init__(self, dtype: str, aligned: bool):
        self.dtype = f"torch.{dtype}"
        self._ptr = 0 if aligned else 8

    def data_ptr(self) -> int:
        return self._ptr


class _CompileOnly:
    """Triton's driver for a process that only compiles: the trainer's target, device 0, the
    null stream (a warm-up launches nothing)."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0


def compile_all(request: dict) -> int:
    """Compiles each launch of `request` (start's JSON); returns how many failed (each said on
    stderr in one line)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    from moe_perf.trainer import kernels

    driver.set_active(_CompileOnly(GPUTarget(*request["target"])))
    failed = 0
    for launch in request["launches"]:
        args = [_Stub(**a) if isinstance(a, dict) else a for a in launch["args"]]
        try:
            getattr(kernels, launch["kernel"]).warmup(*args, grid=(1,), **launch["constexprs"])
        except Exception as e:  # the trainer compiles it itself at its launch
            failed += 1
            print(f"moe_perf.trainer.prebuild: {launch['kernel']}: {e}", file=sys.stderr)
    return failed


if __name__ == "__main__":
    sys.exit(1 if compile_all(json.load(sys.stdin)) else 0)
