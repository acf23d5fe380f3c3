"""The training loop: config -> process group -> model -> steps -> one contract line per step.

    torchrun ... -m moe_perf.trainer <arm_dir>/config.yaml [section.key=value ...]
    python -m moe_perf.trainer <config.yaml>            (one process, no torchrun)

Timing: each step runs between two synchronized points (device synchronize, then a barrier over
all ranks): forward, backward, gradient reduction, clipping and the optimizer step of every
micro-batch are inside; building the step's token batch, the loss read-back and the metric
reductions are outside. tokens/s = global_batch * sequence_length / step time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from moe_perf.common import contract
from moe_perf.common.config import Config, ConfigError, load_config
from moe_perf.common.corpus import CorpusError
from moe_perf.common.mesh import MeshDims, MeshError
from moe_perf.trainer import (
    cp,
    flops,
    imbalance,
    loss,
    moe,
    pp,
    prebuild,
    precision,
    profiling,
    routing,
    stacks,
)
from moe_perf.trainer.data import local_microbatches, make_source
from moe_perf.trainer.model import build_model, cross_entropy
from moe_perf.trainer.parallelize import (
    Parallel,
    clip_coefficient,
    clip_grad_norm_,
    grad_norm,
    init_parallel,
    optimizer_param_groups,
    parallelize,
)
from moe_perf.trainer.runtime import (
    AttentionWarmUp,
    Timeline,
    TrainerError,
    apply_fp8,
    cache_custom_autograd_functions,
    compile_counters,
    compile_phases,
    environment,
    hash_triton_in_background,
    init_distributed,
    mean_over,
    peak_gpu_memory_gib,
    peak_memory_gib,
    resolve_device,
    sync,
    triton_compiles,
    warm_attention_in_background,
    warm_compile_workers,
)

USER_ERRORS = (ConfigError, MeshError, CorpusError)


# --------------------------------------------------------------------------------------------
# Building


@dataclass
class Trainer:
    """Everything a step needs, built once by `build`."""

    cfg: Config
    dims: MeshDims
    device: torch.device
    par: Parallel
    parts: list[nn.Module]  # this rank's model: one module, or its pipeline stages
    pipe: pp.Pipeline | None  # pp > 1: the schedule runs forward and backward
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    autocast: AbstractContextManager
    loss_fn: Callable
    source: object  # data.SyntheticTokens or data.CorpusTokens
    offsets: list[int]  # forced routing: global index of this rank's first token per micro-batch
    device_name: str | None
    clip_in_optimizer: bool = False  # the fused optimizer applies the clip (clip_gradients)
    helper: subprocess.Popen | None = None  # compiling the Triton kernels ahead (prebuild.py)
    attention_warm_up: AttentionWarmUp | None = None  # trainer.warm_attention, joined
    # the step's expert counts, one {layer: counts} per micro-batch (imbalance.py); under pp > 1
    # the pipeline's stages keep them
    token_counts: list = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.par.global_rank


def distribute(model: nn.Module, par: Parallel, cfg: Config):
    """(this rank's parallelized model parts, the pipeline or None). Under pp > 1 the pipeline
    cuts the model into stages and parallelizes each (pp.pipeline); otherwise the whole model
    is parallelized as one part."""
    if par.dims.pp > 1:
        pipe = pp.pipeline(model, par, cfg, parallelize)
        return pipe.modules, pipe
    return [parallelize(model, par, cfg)], None


def build(cfg: Config, out, timeline: Timeline | None = None) -> Trainer:
    """Process group, model (built on the meta device, then only this rank's part allocated:
    its pipeline stages' layers, its EP slice of the experts), optimizer. Prints the env line;
    marks each stage's end on `timeline`."""
    timeline = timeline or Timeline()
    dims = cfg.validate()
    t = cfg.training
    n_micro = dims.microbatches(t.global_batch, t.micro_batch)
    source = make_source(cfg.data, cfg.model, t.seed)  # CorpusError before anything starts
    device = resolve_device(t.device)
    init_distributed(device, dims.world)
    hashing = None
    if device.type == "cuda":
        triton_compiles.install()
        if cfg.trainer.compile:
            warm_compile_workers()
            hashing = hash_triton_in_background()
    warm_up = start_attention_warm_up(cfg, dims, device)
    par = init_parallel(dims, device)
    timeline.mark("process_group")
    if par.global_rank == 0:
        print(contract.format_env(environment(device, dims.world)), file=out, flush=True)

    model = build_model(
        cfg.model, seed=t.seed, force_balance=False, device="meta", init_std=cfg.trainer.init_std
    )
    # routing.mode: forced balance, a skew plan, or the router's own top-k (None)
    moe.set_expert_assignment(model, routing.expert_assignment(cfg, dims, device))
    for layer in moe.moe_layers(model):
        layer.experts.backend = cfg.trainer.expert_backend
        layer.forced_dispatch = cfg.trainer.forced_dispatch
    if cfg.dtype.fp8 or cfg.dtype.name == "fp8":
        apply_fp8(model, device)
    timeline.mark("model_on_meta")
    if cfg.trainer.compile:
        cache_custom_autograd_functions()
    parts, pipe = distribute(model, par, cfg)  # allocates, initialises, wraps in compile
    timeline.mark("parallelized")
    for part in parts:
        part.train()
        moe.set_aux_loss_grad_scale(part, 1.0 / n_micro)
    params = [p for part in parts for p in precision.optimizer_params(part)]
    # Fused AdamW (GPU and CPU, so the CPU tests run the GPU's optimizer path): one kernel per
    # parameter group instead of a dozen foreach passes (72.6 -> 31.9 ms/step on one H200).
    # Over bf16 compute weights, MasterAdamW also writes their copies (inside optimizer.step(),
    # so inside the timed step).
    adamw = dict(lr=t.lr, betas=(0.9, 0.95), weight_decay=cfg.trainer.weight_decay)
    masters = [mw for part in parts if (mw := precision.master_weights(part)) is not None]
    if masters:
        optimizer = precision.MasterAdamW(optimizer_param_groups(params), masters, **adamw)
    else:
        optimizer = torch.optim.AdamW(optimizer_param_groups(params), fused=True, **adamw)
    bf16 = cfg.dtype.name in ("bf16", "fp8")
    tr = Trainer(
        cfg=cfg,
        dims=dims,
        device=device,
        par=par,
        parts=parts,
        pipe=pipe,
        params=params,
        optimizer=optimizer,
        autocast=torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext(),
        # One pass over the bf16 logits forward and one backward (Triton, on CUDA), or compiled:
        # never the logits materialised in fp32 [tokens x vocab].
        loss_fn=loss.cross_entropy_fn(device, cfg.trainer.compile),
        source=source,
        offsets=[
            dims.token_offset(m, par.dp_cp_rank, t.micro_batch, t.sequence_length)
            for m in range(n_micro)
        ],
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        clip_in_optimizer=not any(isinstance(p, DTensor) for p in params),
    )
    tr.helper = prebuild_kernels(tr, n_micro, torch.bfloat16 if bf16 else torch.float32)
    if hashing is not None:
        hashing.join()
    if warm_up is not None:
        warm_up.join()
        tr.attention_warm_up = warm_up
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the warm-up's blocks: the steps' memory as without it
    return tr


def start_attention_warm_up(cfg: Config, dims: MeshDims, device) -> AttentionWarmUp | None:
    """trainer.warm_attention: the attention's first forward and backward in a thread while the
    model is built (runtime.warm_attention_in_background), in the step's compute dtype; None
    when off, and under context parallel (cp.py's attention makes other calls, on chunks)."""
    if not cfg.trainer.warm_attention or dims.cp > 1:
        return None
    t = cfg.training
    dtype = torch.bfloat16 if cfg.dtype.name in ("bf16", "fp8") else torch.float32
    return warm_attention_in_background(cfg.model, t.micro_batch, t.sequence_length, dtype, device)


def prebuild_kernels(tr: Trainer, n_micro: int, logits_dtype: torch.dtype):
    """The helper process compiling the trainer's own Triton kernels for step 1 while step 1
    traces and compiles the model (prebuild.py): on CUDA, by each node's first rank (the
    others find what it compiled in the node's Triton cache). None elsewhere."""
    if tr.device.type != "cuda" or int(os.environ.get("LOCAL_RANK", 0)) != 0:
        return None
    if precision.triton_kernels() is None:
        return None
    from triton.runtime.driver import driver

    launches = []
    if tr.pipe is None:  # the pipeline's last stage computes torch's cross-entropy
        launches += loss.prebuild_launches(tr.cfg.model.vocab_size, logits_dtype)
    if isinstance(tr.optimizer, precision.MasterAdamW):
        clip = tr.clip_in_optimizer and tr.cfg.trainer.max_grad_norm > 0
        launches += tr.optimizer.prebuild_launches(clip, n_micro)
    target = driver.active.get_current_target()
    return prebuild.start(launches, (target.backend, target.arch, target.warp_size))


# --------------------------------------------------------------------------------------------
# One step


def local_batch(tr: Trainer, step: int) -> list[tuple]:
    """This rank's micro-batches of the step, on the device: [(inputs_BS, labels_BS,
    positions_BS or None)], zig-zag sharded over the cp group under context parallel."""
    t, dims = tr.cfg.training, tr.dims
    cp_rank = tr.par.rank("cp")
    microbatches = []
    for inputs_BS, labels_BS in local_microbatches(
        tr.source,
        step,
        global_batch=t.global_batch,
        micro_batch=t.micro_batch,
        seq=t.sequence_length,
        dp=dims.dp,
        dp_rank=tr.par.rank("dp"),
    ):
        positions_BS = None
        if dims.cp > 1:
            inputs_BS, labels_BS, positions_BS = cp.shard_batch(
                inputs_BS, labels_BS, dims.cp, cp_rank
            )
            positions_BS = positions_BS.to(tr.device, non_blocking=True)
        inputs_BS = inputs_BS.to(tr.device, non_blocking=True)
        microbatches.append((inputs_BS, labels_BS.to(tr.device, non_blocking=True), positions_BS))
    return microbatches


def forward_backward(model, microbatches, *, offsets, autocast, loss_fn=cross_entropy,
                     token_counts: list | None = None):  # fmt: skip
    """Gradient accumulation over this rank's micro-batches; returns the mean CE (detached).

    Each micro-batch loss is scaled by 1/M (the MoE balance losses carry the same scale, see
    moe.set_aux_loss_grad_scale), so gradients are those of the step's mean loss.
    `token_counts` gets each micro-batch's expert counts (references, no work).
    """
    total = None
    M = len(microbatches)
    for (inputs_BS, labels_BS, positions_BS), offset in zip(microbatches, offsets, strict=True):
        moe.set_token_offset(model, offset)
        with autocast:
            loss = loss_fn(model(inputs_BS, positions_BS), labels_BS)
        if token_counts is not None:
            token_counts.append(moe.tokens_processed(model))
        (loss / M).backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total / M


def bench_hook() -> None:
    """A no-op called once per step inside the timed region (`train_step`, right before the
    optimizer step), under every mesh. Costs one Python call per step.

    bench/bench_harness.py checks that a planted slowdown is measured: in a throwaway copy of
    this project it replaces this function (found by its line `def bench_hook() -> None:`)
    with a delay. Keep that line, and the call between the step's two timing points.
    """


def clip_gradients(tr: Trainer, max_norm: float) -> None:
    """Global-norm clipping of the step's gradients (no host sync).

    Over plain tensors the clip rides on the fused AdamW step: its kernel divides each gradient
    by the optimizer's `grad_scale` as it reads it (the hook torch's GradScaler unscales
    through), so the clip costs no pass of its own over the fp32 gradients (a read and a write,
    8 B per parameter: 24 GB a step for the 4-layer qwen3-30b-a3b bench). The fused kernel does
    not take DTensors mixed with a plain scale, so FSDP's sharded gradients are scaled in place.
    """
    if not tr.clip_in_optimizer:
        clip_grad_norm_(tr.params, max_norm, tr.par)
        return
    tr.optimizer.grad_scale = 1.0 / clip_coefficient(grad_norm(tr.params, tr.par), max_norm)


def train_step(tr: Trainer, microbatches) -> tuple[torch.Tensor | None, float]:
    """One optimizer step between two synchronized points: (loss tensor, step time in s).

    Forward, backward, gradient reduction, clipping and the optimizer step are timed; the loss
    stays on the device (no host sync inside)."""
    max_norm, optimizer = tr.cfg.trainer.max_grad_norm, tr.optimizer
    tr.token_counts = []
    sync(tr.device)
    t0 = time.perf_counter()
    if tr.pipe is not None:
        loss = pp.forward_backward(tr.pipe, microbatches, tr.autocast)
    else:
        loss = forward_backward(
            tr.parts[0], microbatches, offsets=tr.offsets, autocast=tr.autocast,
            loss_fn=tr.loss_fn, token_counts=tr.token_counts,
        )  # fmt: skip
    if max_norm > 0:
        clip_gradients(tr, max_norm)
    bench_hook()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync(tr.device)
    return loss, time.perf_counter() - t0


def step_counts(tr: Trainer) -> imbalance.StepCounts:
    """The step's slots per expert and per rank, gathered over every rank (imbalance.py: one
    all-reduce; call outside the timed region)."""
    per_microbatch = tr.token_counts
    if tr.pipe is not None:
        per_microbatch = [c for stage in tr.pipe.stages for c in stage.token_counts]
    m = tr.cfg.model
    return imbalance.gather(
        per_microbatch, num_layers=m.num_layers, num_experts=m.num_experts, ep=tr.dims.ep,
        ep_rank=tr.par.ep_rank, dp_cp_rank=tr.par.dp_cp_rank, dp_cp=tr.dims.dp_cp,
        device=tr.device,
    )  # fmt: skip


def step_metrics(tr: Trainer, loss: torch.Tensor | None, step_time: float) -> dict:
    """The contract line's values (collectives and host syncs: outside the timed region).

    Under PP the last stage's loss reaches every pp rank and the balance losses are summed over
    all stages; the loss is then averaged over the data x context ranks. The routing the step
    had: each MoE layer's busiest expert and busiest rank over the mean (imbalance.py)."""
    t = tr.cfg.training
    if tr.pipe is not None:
        loss, aux_value = pp.step_metrics(tr.pipe, loss, nn.ModuleList(tr.parts), tr.device)
    else:
        aux_value = moe.aux_loss_total(tr.parts[0])
    counts = step_counts(tr)
    tokens_per_s = t.global_batch * t.sequence_length / step_time
    tflops, mfu = flops.tflops_and_mfu(
        tr.cfg.model,
        t.sequence_length,
        tokens_per_s,
        tr.dims.world,
        tr.device_name,
        tr.cfg.dtype.name,
    )
    return dict(
        step_time_s=step_time,
        tokens_per_s=tokens_per_s,
        peak_mem_gib=peak_memory_gib(tr.device),
        loss=mean_over(loss, tr.par.group("dp_cp")),
        tflops=tflops,
        mfu=mfu,
        aux_loss=aux_value,
        expert_imbalance=counts.expert_imbalance,
        rank_imbalance=counts.rank_imbalance,
    )


# --------------------------------------------------------------------------------------------
# Profiled steps after the measured ones (explain=true)


def explain(tr: Trainer, steps: int, out_dir) -> None:
    """`steps` more steps after the measured ones, profiled and without contract lines (the
    measured steps are not perturbed). Writes in `out_dir` (default ./explain) per rank
    `trace_rank<r>.json` and, from rank 0, `steps.json`: {"steps": n, "wall_s": [...]} and on
    GPU the run's peak memory allocated and reserved (GiB, max over ranks)."""
    out = Path(out_dir or "explain")
    first = tr.cfg.training.max_steps + 1

    def one_step(i: int) -> float:
        return train_step(tr, local_batch(tr, first + i))[1]

    wall_s = profiling.profile_steps(one_step, steps, tr.device, out / f"trace_rank{tr.rank}.json")
    info = {"steps": steps, "wall_s": wall_s}
    if tr.device.type == "cuda":
        allocated, reserved = peak_gpu_memory_gib(tr.device)
        info.update(peak_mem_allocated_gib=allocated, peak_mem_reserved_gib=reserved)
    if tr.rank == 0:
        (out / "steps.json").write_text(json.dumps(info) + "\n")


# --------------------------------------------------------------------------------------------
# The run


def write_startup(path: Path, timeline: Timeline, warm_up: AttentionWarmUp | None) -> None:
    """Rank 0's start-up timeline (seconds since its process started at each mark: main,
    process_group, model_on_meta, parallelized, step1_done, steps_done, finished) and its
    compile-cache counters, where its compiles' time went (dynamo's phase clocks, the Triton
    kernels it compiled itself), for the runner's record; with trainer.warm_attention, what
    the warm-up took and how long the build waited for it."""
    info = {
        "marks_s": timeline.marks,
        "compile_counters": compile_counters(),
        "compile_phases_s": compile_phases(),
        "triton_in_process": triton_compiles.summary(),
    }
    if warm_up is not None:
        info["attention_warm_up"] = warm_up.summary()
    path.write_text(json.dumps(info) + "\n")


def run(cfg: Config, out=sys.stdout, profile_dir=None, explain_dir=None,
        startup_path=None) -> None:  # fmt: skip
    timeline = Timeline()
    timeline.mark("main")
    sampler = stacks.start(cfg.trainer.sample_stacks_ms, timeline.marks)
    tr = build(cfg, out, timeline)
    try:
        steps(tr, out, timeline, profile_dir, explain_dir)
    finally:
        prebuild.stop(tr.helper)
    timeline.mark("finished")
    if sampler is not None:
        sampler.stop()
        out_dir = profiling.output_dir(cfg.trainer, profile_dir)
        sampler.write(out_dir / f"stacks_rank{tr.rank}.txt")
    if startup_path is not None and tr.rank == 0:
        write_startup(Path(startup_path), timeline, tr.attention_warm_up)


def steps(tr: Trainer, out, timeline: Timeline, profile_dir, explain_dir) -> None:
    """The measured steps (a contract line each from rank 0), the profiled ones after them
    (explain), then the process group's end."""
    cfg = tr.cfg
    max_steps = cfg.training.max_steps
    profiler = profiling.Profiler(cfg.trainer, max_steps, tr.device, tr.rank, profile_dir)
    for step in range(1, max_steps + 1):
        profiler.before_step(step)
        loss, step_time = train_step(tr, local_batch(tr, step))
        profiler.after_step(step)
        metrics = step_metrics(tr, loss, step_time)
        if step == 1:
            timeline.mark("step1_done")
        if tr.rank == 0:
            print(contract.format_step(step, max_steps, **metrics), file=out, flush=True)
    timeline.mark("steps_done")
    if cfg.trainer.explain_steps > 0:
        explain(tr, cfg.trainer.explain_steps, explain_dir)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    """Exit status: 0 done, 2 a config/mesh/corpus/environment problem, 1 anything else."""
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: python -m moe_perf.trainer CONFIG.yaml [section.key=value ...]", file=sys.stderr
        )
        return 0 if argv else 2
    try:
        arm_dir = Path(argv[0]).resolve().parent
        cfg = load_config(argv[0], argv[1:])
        run(
            cfg,
            profile_dir=arm_dir / "profile",
            explain_dir=arm_dir / "explain",
            startup_path=arm_dir / "startup.json",
        )
        return 0
    except (*USER_ERRORS, TrainerError) as e:
        print(f"moe_perf.trainer: error: {e}", file=sys.stderr)
        return 2
    except Exception:
        traceback.print_exc()
        print("moe_perf.trainer: error: training failed (traceback above)", file=sys.stderr)
        return 1
