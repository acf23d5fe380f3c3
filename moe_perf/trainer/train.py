"""The training loop: config -> process group -> model -> steps -> one contract line per step.

    torchrun ... -m moe_perf.trainer <arm_dir>/config.yaml [section.key=value ...]
    python -m moe_perf.trainer <config.yaml>            (one process, no torchrun)

Building a rank's trainer is trainer/startup.py's (`build`, `Trainer`).

Timing: each step runs between two synchronized points (device synchronize, then a barrier over
all ranks): forward, backward, gradient reduction, clipping and the optimizer step of every
micro-batch are inside; building the step's token batch, the loss read-back and the metric
reductions are outside. tokens/s = global_batch * sequence_length / step time.
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from moe_perf.common import contract
from moe_perf.common.config import Config, ConfigError, load_config
from moe_perf.common.corpus import CorpusError
from moe_perf.common.mesh import MeshError
from moe_perf.trainer import (
    cp,
    early,
    flops,
    imbalance,
    moe,
    pp,
    prebuild,
    profiling,
    stacks,
)
from moe_perf.trainer.data import local_microbatches
from moe_perf.trainer.model import cross_entropy
from moe_perf.trainer.parallelize import (
    clip_coefficient,
    clip_grad_norm_,
    grad_norm,
)
from moe_perf.trainer.runtime import (
    AttentionWarmUp,
    Timeline,
    TrainerError,
    compile_counters,
    compile_phases,
    mean_over,
    peak_gpu_memory_gib,
    peak_memory_gib,
    sync,
    triton_compiles,
)
from moe_perf.trainer.startup import Trainer, build
from moe_perf.trainer.startup import distribute as distribute  # importable from here too
from moe_perf.trainer.startup import start_attention_warm_up as start_attention_warm_up

USER_ERRORS = (ConfigError, MeshError, CorpusError)


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


def write_startup(
    path: Path,
    timeline: Timeline,
    warm_up: AttentionWarmUp | None,
    early_context: early.EarlyContext | None = None,
    gc_frozen: int | None = None,
) -> None:
    """Rank 0's start-up timeline (seconds since its process started at each mark: main,
    process_group, model_on_meta, parallelized, step1_done, steps_done, finished, and its minor
    page faults so far at each) and its compile-cache counters, where its compiles' time went
    (dynamo's phase clocks, the Triton kernels it compiled itself), for the runner's record;
    with trainer.warm_attention, what the warm-up took and how long the build waited for it;
    with trainer.early_cuda_context, when the context's thread started, what it took and how
    long the build waited for it; with trainer.gc_freeze, how many objects it froze."""
    info = {
        "marks_s": timeline.marks,
        "minor_faults": timeline.minor_faults,
        "compile_counters": compile_counters(),
        "compile_phases_s": compile_phases(),
        "triton_in_process": triton_compiles.summary(),
    }
    if warm_up is not None:
        info["attention_warm_up"] = warm_up.summary()
    if early_context is not None:
        info["early_cuda_context"] = early_context.summary()
    if gc_frozen is not None:
        info["gc_frozen_objects"] = gc_frozen
    path.write_text(json.dumps(info) + "\n")


@contextlib.contextmanager
def imports_frozen(freeze: bool):
    """With `freeze`, every object the garbage collector tracks now (those of the imports:
    torch's modules, functions and classes, some 300,000) moved to its permanent generation,
    which no collection walks, until the run ends: step 1's trace allocates enough to run full
    collections, and each walked them all. No collection first: that would be one such walk,
    and the imports leave little garbage. Yields how many objects are frozen (None without)."""
    if not freeze:
        yield None
        return
    gc.freeze()
    try:
        yield gc.get_freeze_count()
    finally:
        gc.unfreeze()  # a run inside a longer process (the tests) leaves its collector as it was


def run(cfg: Config, out=sys.stdout, profile_dir=None, explain_dir=None,
        startup_path=None, early_context: early.EarlyContext | None = None) -> None:  # fmt: skip
    """The trainer's run: build, measured steps, start-up record. `early_context`: the CUDA
    context's thread that __main__ started before the imports (trainer/early.py), joined
    before the build's first CUDA call."""
    timeline = Timeline()
    timeline.mark("main")
    with imports_frozen(cfg.trainer.gc_freeze) as frozen:
        sampler = stacks.start(cfg.trainer.sample_stacks_ms, timeline.marks)
        if early_context is not None:
            early_context.join()
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
            write_startup(Path(startup_path), timeline, tr.attention_warm_up, early_context,
                          frozen)  # fmt: skip


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


def main(argv: list[str], early_context: early.EarlyContext | None = None) -> int:
    """Exit status: 0 done, 2 a config/mesh/corpus/environment problem, 1 anything else.
    `early_context`: trainer/early.py's thread, started by __main__ before these imports."""
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
            early_context=early_context,
        )
        return 0
    except (*USER_ERRORS, TrainerError) as e:
        print(f"moe_perf.trainer: error: {e}", file=sys.stderr)
        return 2
    except Exception:
        traceback.print_exc()
        print("moe_perf.trainer: error: training failed (traceback above)", file=sys.stderr)
        return 1
