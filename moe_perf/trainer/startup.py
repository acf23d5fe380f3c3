"""Building one rank's trainer: process group, model, optimizer, and the helpers that overlap
start-up (compile workers, the attention's warm-up, the Triton kernels compiled ahead).

The model is built on the meta device, then only this rank's part is allocated: its pipeline
stages' layers, its EP slice of the experts (parallelize.py). `build` marks each stage's end on
the start-up timeline the runner records.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moe_perf.common import contract
from moe_perf.common.config import Config
from moe_perf.common.mesh import MeshDims
from moe_perf.trainer import loss, moe, pp, prebuild, precision, routing
from moe_perf.trainer.data import make_source
from moe_perf.trainer.model import build_model
from moe_perf.trainer.parallelize import (
    Parallel,
    init_parallel,
    optimizer_param_groups,
    parallelize,
)
from moe_perf.trainer.runtime import (
    AttentionWarmUp,
    Timeline,
    apply_fp8,
    cache_custom_autograd_functions,
    environment,
    hash_triton_in_background,
    init_distributed,
    resolve_device,
    triton_compiles,
    warm_attention_in_background,
    warm_compile_workers,
)


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
    hashing = start_compile_helpers(cfg, device)
    warm_up = start_attention_warm_up(cfg, dims, device)
    par = init_parallel(dims, device)
    timeline.mark("process_group")
    if par.global_rank == 0:
        print(contract.format_env(environment(device, dims.world)), file=out, flush=True)
    model = model_on_meta(cfg, dims, device)
    timeline.mark("model_on_meta")
    if cfg.trainer.compile:
        cache_custom_autograd_functions()
    parts, pipe = distribute(model, par, cfg)  # allocates, initialises, wraps in compile
    timeline.mark("parallelized")
    for part in parts:
        part.train()
        moe.set_aux_loss_grad_scale(part, 1.0 / n_micro)
    params = [p for part in parts for p in precision.optimizer_params(part)]
    bf16 = cfg.dtype.bf16_compute
    tr = Trainer(
        cfg=cfg,
        dims=dims,
        device=device,
        par=par,
        parts=parts,
        pipe=pipe,
        params=params,
        optimizer=make_optimizer(cfg, parts, params),
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
    join_start_up_helpers(tr, hashing, warm_up)
    return tr


def start_compile_helpers(cfg: Config, device: torch.device):
    """On CUDA: Triton's compiles counted, and under trainer.compile inductor's compile workers
    started and Triton's source hashed in a thread while the model is built. The hashing
    thread (join it), or None."""
    if device.type != "cuda":
        return None
    triton_compiles.install()
    if not cfg.trainer.compile:
        return None
    warm_compile_workers()
    return hash_triton_in_background()


def model_on_meta(cfg: Config, dims: MeshDims, device: torch.device) -> nn.Module:
    """The whole model on the meta device, with its routing, experts' backend and float8
    linears set: nothing allocated yet."""
    model = build_model(
        cfg.model,
        seed=cfg.training.seed,
        force_balance=False,
        device="meta",
        init_std=cfg.trainer.init_std,
    )
    # routing.mode: forced balance, a skew plan, or the router's own top-k (None)
    moe.set_expert_assignment(model, routing.expert_assignment(cfg, dims, device))
    for layer in moe.moe_layers(model):
        layer.experts.backend = cfg.trainer.expert_backend
        layer.forced_dispatch = cfg.trainer.forced_dispatch
    if cfg.dtype.float8:
        apply_fp8(model, device)
    return model


def make_optimizer(cfg: Config, parts: list[nn.Module], params: list) -> torch.optim.Optimizer:
    """Fused AdamW (GPU and CPU, so the CPU tests run the GPU's optimizer path): one kernel per
    parameter group instead of a dozen foreach passes (72.6 -> 31.9 ms/step on one H200).
    Over bf16 compute weights, MasterAdamW also writes their copies (inside optimizer.step(),
    so inside the timed step)."""
    adamw = dict(lr=cfg.training.lr, betas=(0.9, 0.95), weight_decay=cfg.trainer.weight_decay)
    masters = [mw for part in parts if (mw := precision.master_weights(part)) is not None]
    if masters:
        return precision.MasterAdamW(optimizer_param_groups(params), masters, **adamw)
    return torch.optim.AdamW(optimizer_param_groups(params), fused=True, **adamw)


def join_start_up_helpers(tr: Trainer, hashing, warm_up: AttentionWarmUp | None) -> None:
    """Waits for the helpers that overlapped the build; the warm-up's blocks given back."""
    if hashing is not None:
        hashing.join()
    if warm_up is not None:
        warm_up.join()
        tr.attention_warm_up = warm_up
        if tr.device.type == "cuda":
            torch.cuda.empty_cache()  # the warm-up's blocks: the steps' memory as without it


def start_attention_warm_up(cfg: Config, dims: MeshDims, device) -> AttentionWarmUp | None:
    """trainer.warm_attention: the attention's first forward and backward in a thread while the
    model is built (runtime.warm_attention_in_background), in the step's compute dtype; None
    when off, and under context parallel (cp.py's attention makes other calls, on chunks)."""
    if not cfg.trainer.warm_attention or dims.cp > 1:
        return None
    t = cfg.training
    dtype = torch.bfloat16 if cfg.dtype.bf16_compute else torch.float32
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
