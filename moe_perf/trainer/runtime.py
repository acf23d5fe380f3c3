"""The trainer's process: its device, its process group, the environment line, the
synchronisation around a timed step, and the cross-rank reductions behind a step's metrics."""

from __future__ import annotations

import os
import platform
import resource
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_perf.common.config import ConfigError, ModelConfig
from moe_perf.common.peak_rss import peak_rss_bytes
from moe_perf.trainer.attention import causal_attention
from moe_perf.trainer.clock import HelperThread, process_age_s


class TrainerError(RuntimeError):
    """A run that cannot start on this machine (fp8 without support, world size mismatch)."""


class Timeline:
    """Start-up marks: seconds since the process started at named points, and the process's
    minor page faults so far at each (startup.json): a fork's first writes to the pages it
    shares with its parent are such faults (launcher.preload)."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self.minor_faults: dict[str, int] = {}

    def mark(self, name: str) -> None:
        self.marks[name] = round(process_age_s(), 3)
        self.minor_faults[name] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def compile_counters() -> dict[str, int]:
    """torch's compile-cache counters of this process: inductor's fxgraph_cache_{hit,miss,
    bypass} and AOTAutograd's autograd_cache_{hit,miss,bypass,saved}; empty without compile."""
    if "torch._dynamo" not in sys.modules:
        return {}
    from torch._dynamo.utils import counters

    found = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    found.update({k: v for k, v in counters["aot_autograd"].items() if "autograd_cache" in k})
    return dict(sorted(found.items()))


# Where a compiled step 1 goes, for startup.json: dynamo's own phase clocks (seconds summed over
# every compile of the process; nested, so they do not add up) ...
COMPILE_PHASES = {
    "dynamo_total": "_compile.compile_inner",
    "dynamo_trace": "bytecode_tracing",
    "backend": "OutputGraph.call_user_compiler",
    "aot_trace_joint": "aot_trace_joint_graph",
    "partition": "min_cut_rematerialization_partition",
    "inductor_forward": "compile_fx.<locals>.fw_compiler_base",
    "inductor_backward": "compile_fx.<locals>.bw_compiler",
    "codegen": "GraphLowering.codegen",
    "load_modules": "PyCodeCache.load_by_key_path",
    "wait_for_kernel_workers": "async_compile.wait",
    # at a kernel's first launch: inductor times each of its candidate configs (reductions,
    # 2-D pointwise) and keeps the fastest (the choice is cached with the kernels)
    "runtime_autotune": "CachingAutotuner.benchmark_all_configs",
}


def compile_phases() -> dict[str, float]:
    """Seconds in each of COMPILE_PHASES this process (absent: never entered); empty without
    compile."""
    if "torch._dynamo" not in sys.modules:
        return {}
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    seconds = dict(zip(names, map(float, values), strict=True))
    return {k: round(seconds[v], 3) for k, v in COMPILE_PHASES.items() if v in seconds}


class TritonCompiles:
    """... and the Triton kernels this process compiled itself (the trainer's own kernels; the
    compile workers' kernels are only loaded here): how many, and the seconds they took.
    Listens through Triton's compilation listener where it has one (Triton >= 3.4)."""

    def __init__(self) -> None:
        self.compiled: dict[str, float] = {}
        self.loaded = 0

    def install(self) -> None:
        try:
            from triton import knobs
        except ImportError:
            return
        if hasattr(knobs, "compilation") and knobs.compilation.listener is None:
            knobs.compilation.listener = self

    def __call__(self, *, src, metadata, metadata_group, times, cache_hit) -> None:
        if cache_hit:
            self.loaded += 1
            return
        name = str(metadata.get("name", "?"))
        self.compiled[name] = round(self.compiled.get(name, 0.0) + times.total / 1e6, 3)

    def summary(self) -> dict:
        return {
            "compiled": len(self.compiled),
            "compile_s": round(sum(self.compiled.values()), 3),
            "loaded_from_cache": self.loaded,
            "kernels_s": self.compiled,
        }


triton_compiles = TritonCompiles()


def warm_compile_workers() -> None:
    """Start inductor's compile-worker pool now rather than at the first compile (after dynamo
    has traced step 1), so its processes start while the model is built. Inductor starts the
    same pool itself (torch's TORCH_WARM_POOL=0 still turns it off); compiled arms on CUDA only,
    where the pool compiles the Triton kernels."""
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()


def hash_triton_in_background() -> threading.Thread:
    """Triton's version key, computed in a thread while the model is built; join it before
    step 1. The key is a SHA-256 of Triton's sources and of its 400 MB libtriton.so, computed
    once per process (lru-cached) when the first compile builds its cache keys, warm or cold:
    0.35 s of step 1 on an H100 VM. Hashing and reading release the GIL."""
    from torch._inductor.runtime.triton_compat import HAS_TRITON, triton_key

    thread = threading.Thread(target=triton_key if HAS_TRITON else None, daemon=True)
    thread.start()
    return thread


WARM_ATTENTION_THREAD = "moe_perf-warm-attention"


@dataclass
class AttentionWarmUp(HelperThread):
    """The attention warm-up's thread (`warm_attention_in_background`): its forward and
    backward's seconds, and what SDPA refused if it did."""


def warm_attention_in_background(
    m: ModelConfig, batch: int, seq: int, dtype: torch.dtype, device: torch.device
) -> AttentionWarmUp:
    """One causal GQA attention forward and backward at the step's shapes (model `m`, `batch`
    sequences of `seq` tokens, `dtype`), through the model's own call, in a thread while the
    model is built (trainer.warm_attention); join it before step 1. On an H100, cuDNN's
    attention cost its process 0.69 s at its first forward and 0.67 s at its first backward,
    inside step 1; a thread that had run one first left 43 ms to the main thread's first
    forward and 2.5 ms to the backward (bench/bench_first_calls.py --side-thread: the first use
    is mostly per process; the backward runs on autograd's device thread, shared). The op
    runs without the GIL, beside the build's imports."""

    def attend() -> None:
        t0 = time.perf_counter()
        try:
            _attention_forward_backward(m, batch, seq, dtype, device)
        except Exception as e:  # step 1 runs the same call and reports it
            warm_up.error = f"{type(e).__name__}: {e}"
        warm_up.seconds = round(time.perf_counter() - t0, 3)

    warm_up = AttentionWarmUp(threading.Thread(target=attend, name=WARM_ATTENTION_THREAD,
                                               daemon=True))  # fmt: skip
    warm_up.thread.start()
    return warm_up


def _attention_forward_backward(m: ModelConfig, batch: int, seq: int, dtype, device) -> None:
    # zeros, not random: the global generators stay the model's (its init, its data); the
    # kernels and plans chosen depend on shapes, strides and dtype only
    kv, v_dim = m.num_kv_heads, m.v_head_dim or m.head_dim
    new = dict(device=device, dtype=dtype, requires_grad=True)
    q_BHSd = torch.zeros(batch, m.num_heads, seq, m.head_dim, **new)
    k_BGSd = torch.zeros(batch, kv, seq, m.head_dim, **new)
    v_BGSv = torch.zeros(batch, seq, kv, v_dim, **new).transpose(1, 2)  # the model's view
    out = causal_attention(q_BHSd, k_BGSd, v_BGSv)
    out.backward(torch.ones_like(out))


def cache_custom_autograd_functions() -> None:
    """Let AOTAutograd's cache keep graphs that hold a custom autograd.Function (before the
    first compile). torch bypasses them by default, so every compiled arm re-traced and
    re-partitioned the MoE layer's forward and backward (dispatch.py's permutations, the
    balance loss's attachment) even when inductor's FX-graph cache had all its kernels.

    Reuse stays exact: dynamo traces a Function's forward and backward into subgraphs of the
    graph it hands AOTAutograd, and the cache key pickles that graph with its subgraphs' code,
    so an arm whose Function changed (forward or backward) misses (tests/test_compile_cache.py).
    The trainer's Functions hold nothing outside their inputs and the constants the graphs
    carry (dispatch.py, balance.py, cp.py)."""
    from torch._functorch import config

    config.autograd_cache_allow_custom_autograd_functions = True


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise TrainerError("training.device=cuda but no CUDA device is available")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if name != "cpu":
        raise ConfigError(f"training.device={name!r}: expected auto, cpu or cuda")
    return torch.device("cpu")


def init_distributed(device: torch.device, expected_world: int) -> None:
    """A process group when launched as one of several ranks (torchrun's environment).

    One rank gets none, also under torchrun: at world size 1 there is no FSDP, EP, CP or PP,
    so nothing to communicate, and NCCL's start-up for a group of one cost 0.4-0.8 s of every
    one-GPU arm on an H200."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world != expected_world:
        raise TrainerError(
            f"launched with {world} processes but mesh.nnodes * mesh.nproc_per_node = "
            f"{expected_world}; change mesh.nproc_per_node or the launch"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" not in os.environ or world == 1 or dist.is_initialized():
        return  # one rank; or a group the caller made (tests: tests/distributed_util.py)
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")


def apply_fp8(model: torch.nn.Module, device: torch.device) -> None:
    """torchao float8 training for the Linear layers (router and head stay in bf16)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise TrainerError(
            "dtype=fp8 needs a GPU with fp8 tensor cores (compute capability "
            f">= 8.9); this run is on {device}: use dtype=bf16"
        )
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as e:
        raise TrainerError("dtype=fp8 needs torchao (pip install torchao); use dtype=bf16") from e

    def eligible(mod, fqn: str) -> bool:
        return (
            isinstance(mod, torch.nn.Linear)
            and "router" not in fqn
            and fqn != "output"
            and mod.in_features % 16 == 0
            and mod.out_features % 16 == 0
        )

    convert_to_float8_training(model, module_filter_fn=eligible)


def environment(device: torch.device, world: int) -> dict:
    cuda = device.type == "cuda"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
    devices = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    )
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "nccl": nccl,
        "devices": devices,
        "world_size": world,
        "python": platform.python_version(),
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()


def peak_memory_gib(device: torch.device) -> float:
    """Max over ranks: GPU max reserved; CPU the process's own peak RSS (never ru_maxrss,
    which holds the launcher's peak: common/peak_rss.py)."""
    if device.type == "cuda":
        local = torch.cuda.max_memory_reserved(device)
    else:
        local = peak_rss_bytes()
    t = torch.tensor([float(local)], device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() / 2**30


def mean_over(value: torch.Tensor, group) -> float:
    if group is not None and dist.get_world_size(group) > 1:
        value = value.clone()
        dist.all_reduce(value, group=group)
        value /= dist.get_world_size(group)
    return value.item()


def peak_gpu_memory_gib(device: torch.device) -> tuple[float, float]:
    """(max allocated, max reserved) GPU memory of the run so far, max over ranks."""
    peaks = torch.tensor(
        [torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)],
        dtype=torch.float64,
        device=device,
    )
    if dist.is_initialized():
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    allocated, reserved = (peaks / 2**30).tolist()
    return allocated, reserved
