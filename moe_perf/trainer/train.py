"""The training loop: config -> process group -> model -> steps -> one contract line per step.

    torchrun ... -m moe_perf.trainer <arm_dir>/config.yaml [section.key=value ...]
    python -m moe_perf.trainer <config.yaml>            (one process, no torchrun)

Timing: each step runs between two synchronized points (device synchronize, then a barrier over
all ranks): forward, backward, gradient reduction, clipping and the optimizer step of every
micro-batch are inside; building the step's token batch, the loss read-back and the metric
reductions are outside. tokens/s = global_batch * sequence_length / step time.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import resource
import sys
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from moe_perf.common import contract
from moe_perf.common.config import Config, ConfigError, load_config
from moe_perf.common.corpus import CorpusError
from moe_perf.common.mesh import MeshError
from moe_perf.trainer import flops, moe
from moe_perf.trainer.data import local_microbatches, make_source
from moe_perf.trainer.model import build_model, cross_entropy

USER_ERRORS = (ConfigError, MeshError, CorpusError)


class TrainerError(RuntimeError):
    """A run that cannot start on this machine (fp8 without support, world size mismatch)."""


# --------------------------------------------------------------------------------------------
# Set-up


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
    """A process group whenever launched by torchrun (even with one process)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world != expected_world:
        raise TrainerError(
            f"launched with {world} processes but mesh.nnodes * mesh.nproc_per_node = "
            f"{expected_world}; change mesh.nproc_per_node or the launch"
        )
    if "RANK" not in os.environ:
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")


def parallel_api():
    """parallelize.py's (init_parallel, parallelize, clip_grad_norm_), or None if absent."""
    if importlib.util.find_spec("moe_perf.trainer.parallelize") is None:
        return None
    from moe_perf.trainer import parallelize as p

    return p


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
    """Max over ranks: GPU max reserved; CPU max RSS of the process (ru_maxrss is KiB)."""
    if device.type == "cuda":
        local = torch.cuda.max_memory_reserved(device)
    else:
        local = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
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


# --------------------------------------------------------------------------------------------
# The step


def forward_backward(model, microbatches, *, offsets, autocast, loss_fn=cross_entropy):
    """Gradient accumulation over this rank's micro-batches; returns the mean CE (detached).

    Each micro-batch loss is scaled by 1/M (the MoE balance losses carry the same scale, see
    moe.set_aux_loss_grad_scale), so gradients are those of the step's mean loss.
    """
    total = None
    M = len(microbatches)
    for (inputs_BS, labels_BS, positions_BS), offset in zip(microbatches, offsets, strict=True):
        moe.set_token_offset(model, offset)
        with autocast:
            loss = loss_fn(model(inputs_BS, positions_BS), labels_BS)
        (loss / M).backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total / M


class Profiler:
    """torch.profiler over the last `trainer.profile_steps` steps; writes, per rank,
    `kernels_rank<r>.txt` (ops by device time) and `trace_rank<r>.json` (Chrome trace).

    The profiled steps are still timed and printed; tracing costs a little host time per op,
    so read their step times with that in mind (bench/profile_summary.py reads the trace).
    """

    def __init__(self, tcfg, max_steps: int, device: torch.device, rank: int, out_dir):
        n = min(tcfg.profile_steps, max_steps)
        self.first = max_steps - n + 1 if n > 0 else None
        self.last = max_steps
        self.device, self.rank = device, rank
        self.out_dir = tcfg.profile_dir or out_dir
        self.prof = None

    def before_step(self, step: int) -> None:
        if step != self.first:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.prof = profile(activities=activities)
        self.prof.start()

    def after_step(self, step: int) -> None:
        if self.prof is None or step != self.last:
            return
        self.prof.stop()
        out = Path(self.out_dir or "profile")
        out.mkdir(parents=True, exist_ok=True)
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = self.prof.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=90)
        (out / f"kernels_rank{self.rank}.txt").write_text(table + "\n")
        self.prof.export_chrome_trace(str(out / f"trace_rank{self.rank}.json"))
        self.prof = None


def run(cfg: Config, out=sys.stdout, profile_dir=None) -> None:
    dims = cfg.validate()
    t = cfg.training
    source = make_source(cfg.data, cfg.model, t.seed)  # CorpusError before anything starts
    device = resolve_device(t.device)
    init_distributed(device, dims.world)
    rank = dist.get_rank() if dist.is_initialized() else 0
    api = parallel_api()
    if api is None and dims.world > 1:
        raise TrainerError("this trainer has no parallelize.py: only one process can run")
    par = api.init_parallel(dims, device) if api else None
    dp_cp_rank = par.dp_cp_rank if par else 0
    dp_rank, cp_rank = (par.rank("dp"), par.rank("cp")) if par else (0, 0)

    if rank == 0:
        print(contract.format_env(environment(device, dims.world)), file=out, flush=True)

    # With parallelize.py the model starts on the meta device: it allocates and initialises
    # only this rank's part (its pipeline stages' layers, its EP slice of the experts).
    model = build_model(
        cfg.model,
        seed=t.seed,
        force_balance=t.benchmark,
        balance_ep=dims.ep,
        device="meta" if api else device,
        init_std=cfg.trainer.init_std,
    )
    for layer in moe.moe_layers(model):
        layer.experts.backend = cfg.trainer.expert_backend
    if cfg.dtype.fp8 or cfg.dtype.name == "fp8":
        apply_fp8(model, device)
    if api:
        model = api.parallelize(model, par, cfg)
    pipe = par.pipeline if par is not None else None  # PP: the schedule runs the step (pp.py)
    # Under PP with virtual stages a rank holds several stage modules: train all of them.
    parts = [st.submod for st in pipe.stages] if pipe is not None else [model]
    for part in parts:
        part.train()
    params = [p for part in parts for p in part.parameters() if p.requires_grad]
    # Fused AdamW (GPU and CPU, so the CPU tests run the GPU's optimizer path): one kernel per
    # parameter group instead of a dozen foreach passes (72.6 -> 31.9 ms/step on one H200).
    groups = api.optimizer_param_groups(params) if api else [{"params": params}]
    optimizer = torch.optim.AdamW(
        groups,
        lr=t.lr,
        betas=(0.9, 0.95),
        weight_decay=cfg.trainer.weight_decay,
        fused=True,
    )
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if cfg.dtype.name in ("bf16", "fp8")
        else nullcontext()
    )

    # Compiled, the loss reads the bf16 logits once (fp32 upcast and log-softmax fused) instead
    # of materialising them in fp32 [tokens x vocab].
    loss_fn = torch.compile(cross_entropy) if cfg.trainer.compile else cross_entropy

    S, mb = t.sequence_length, t.micro_batch
    tokens_per_micro = mb * S // dims.cp
    n_micro = t.global_batch // (dims.dp * mb)
    moe.set_aux_loss_grad_scale(model, 1.0 / n_micro)
    # Forced balance counts slots by global token index: micro-batch-major over dp x cp ranks.
    offsets = [(m * dims.dp_cp + dp_cp_rank) * tokens_per_micro for m in range(n_micro)]
    dp_cp_group = par.group("dp_cp") if par else None
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None

    profiler = Profiler(cfg.trainer, t.max_steps, device, rank, profile_dir)
    for step in range(1, t.max_steps + 1):
        profiler.before_step(step)
        microbatches = []
        for inputs_BS, labels_BS in local_microbatches(
            source,
            step,
            global_batch=t.global_batch,
            micro_batch=mb,
            seq=S,
            dp=dims.dp,
            dp_rank=dp_rank,
        ):
            positions_BS = None
            if dims.cp > 1:
                from moe_perf.trainer import cp

                inputs_BS, labels_BS, positions_BS = cp.shard_batch(
                    inputs_BS, labels_BS, dims.cp, cp_rank
                )
                positions_BS = positions_BS.to(device, non_blocking=True)
            microbatches.append(
                (
                    inputs_BS.to(device, non_blocking=True),
                    labels_BS.to(device, non_blocking=True),
                    positions_BS,
                )
            )

        sync(device)
        t0 = time.perf_counter()
        if pipe is not None:  # PP: forward and backward of every micro-batch, pipelined
            from moe_perf.trainer import pp

            loss = pp.forward_backward(pipe, microbatches, autocast)
        else:
            loss = forward_backward(
                model, microbatches, offsets=offsets, autocast=autocast, loss_fn=loss_fn
            )
        if cfg.trainer.max_grad_norm > 0:
            if api:
                api.clip_grad_norm_(params, cfg.trainer.max_grad_norm, par)
            else:
                torch.nn.utils.clip_grad_norm_(params, cfg.trainer.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        step_time = time.perf_counter() - t0
        profiler.after_step(step)

        # Outside the timed region: host syncs and small reductions for the line.
        if pipe is not None:  # PP: the last stage's loss reaches rank 0; aux sums all stages
            loss, aux_value = pp.step_metrics(pipe, loss, torch.nn.ModuleList(parts), device)
        else:
            aux_value = moe.aux_loss_total(model)
        loss_value = mean_over(loss, dp_cp_group)
        peak = peak_memory_gib(device)
        tokens_per_s = t.global_batch * S / step_time
        tflops, mfu = flops.tflops_and_mfu(
            cfg.model, S, tokens_per_s, dims.world, device_name, cfg.dtype.name
        )
        if rank == 0:
            print(
                contract.format_step(
                    step,
                    t.max_steps,
                    step_time_s=step_time,
                    tokens_per_s=tokens_per_s,
                    peak_mem_gib=peak,
                    loss=loss_value,
                    tflops=tflops,
                    mfu=mfu,
                    aux_loss=aux_value,
                ),
                file=out,
                flush=True,
            )

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
        run(load_config(argv[0], argv[1:]), profile_dir=Path(argv[0]).resolve().parent / "profile")
        return 0
    except (*USER_ERRORS, TrainerError) as e:
        print(f"moe_perf.trainer: error: {e}", file=sys.stderr)
        return 2
    except Exception:
        traceback.print_exc()
        print("moe_perf.trainer: error: training failed (traceback above)", file=sys.stderr)
        return 1
