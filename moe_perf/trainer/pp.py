"""Pipeline parallel: split the model into stages and run a torch.distributed.pipelining schedule.

`pipeline(model, par, cfg, parallelize)` cuts the model into this rank's stages
(`split_model`), runs the per-stage `parallelize` on each (EP, materialization, CP, compile,
FSDP: parallelize.py) and builds the schedule over them (`build_pipeline`). The train loop
then calls `Pipeline.step` instead of forward/backward.

Stages: the model is cut into pp * virtual_stages contiguous stages, balanced by the per-layer
FLOP model of flops.py (embedding with the first stage, final norm + head with the last: the
head counts 2*hidden*vocab per token, often worth several layers). Stage s lives on pp rank s %
pp (the looped placement Interleaved1F1B expects). A stage module is a `Transformer` that keeps
its own layers (same parameter names as the full model) and None for the pieces it lacks; layers
are moved, never copied.

Loss and gradients: the loss of a microbatch is mean token cross-entropy / n_microbatches and
the schedule runs with scale_grads=False, so each microbatch backward adds exactly what the
single-process loop adds. The load-balance losses live on every stage: each MoE layer attaches
its loss to its output with a straight-through identity (balance.attach_aux_loss) whose backward
feeds `aux_loss_grad_scale` = 1 / n_microbatches into the loss; the stage backward that the
schedule runs (from the next stage's gradient, or from the loss on the last stage) therefore
carries every stage's balance loss. Nothing crosses stages but hidden states and their
gradients.

Forced routing: the global token offset of a microbatch depends on its index. Forward and
backward of one microbatch are not adjacent under 1F1B, and activation checkpointing recomputes
routing in backward, so the stage sets the offset before every forward AND backward chunk.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from moe_perf.common.config import ConfigError, ModelConfig
from moe_perf.common.mesh import check_microbatches
from moe_perf.trainer.flops import head_forward_flops, layer_forward_flops
from moe_perf.trainer.model import Transformer, cross_entropy
from moe_perf.trainer.moe import (
    aux_loss_total,
    set_aux_loss_grad_scale,
    set_token_offset,
    tokens_processed,
)

SCHEDULES = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
}
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")


# ---------------------------------------------------------------------------------------------
# Costs and the split


def partition(costs: list[float], num_stages: int, *, first_extra=0.0, last_extra=0.0):
    """Contiguous split of layers into `num_stages` non-empty stages minimising the costliest.

    Exact dynamic programme over cut points (layers are few); `first_extra`/`last_extra` are
    the embedding and head costs carried by the first and last stage.
    """
    n = len(costs)
    if num_stages > n:
        raise ConfigError(
            f"{num_stages} pipeline stages need at least as many layers, the model has {n}: "
            "change mesh.pp or trainer.pp_virtual_stages"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(s: int, i: int, j: int) -> float:  # stage s holds layers i..j-1
        extra = (first_extra if s == 0 else 0.0) + (last_extra if s == num_stages - 1 else 0.0)
        return prefix[j] - prefix[i] + extra

    inf = float("inf")
    # best[s][j]: minimal max cost placing layers 0..j-1 into stages 0..s; cut[s][j]: start of s
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n + 1):
        best[0][j] = stage_cost(0, 0, j)
    for s in range(1, num_stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                value = max(best[s - 1][i], stage_cost(s, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    bounds, j = [], n
    for s in range(num_stages - 1, 0, -1):
        i = cut[s][j]
        bounds.append((i, j))
        j = i
    bounds.append((0, j))
    return [list(range(i, j)) for i, j in reversed(bounds)]


def stage_layers(m: ModelConfig, seq_len: int, num_stages: int) -> list[list[int]]:
    """Layer ids of every stage, balanced by FLOPs (the embedding lookup costs ~nothing)."""
    costs = [layer_forward_flops(m, i, seq_len) for i in range(m.num_layers)]
    return partition(costs, num_stages, last_extra=head_forward_flops(m))


def local_stage_ids(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """Looped placement: rank r runs stages r, r + pp, r + 2*pp, ..."""
    return [pp_rank + v * pp for v in range(virtual_stages)]


def split_model(
    model: Transformer, *, pp_rank: int, pp: int, virtual_stages: int, seq_len: int
) -> tuple[list[Transformer], list[int]]:
    """This rank's stage modules (and their global stage ids), cut from `model`.

    Layers not on this rank are dropped (their memory goes with the model); kept modules are
    shared with `model`, so attributes set on its MoE layers later still reach them.
    """
    num_stages = pp * virtual_stages
    layers_of = stage_layers(model.config, seq_len, num_stages)
    ids = local_stage_ids(pp_rank, pp, virtual_stages)
    pieces = {
        "layers": model.layers,
        "tok_embeddings": model.tok_embeddings,
        "norm": model.norm,
        "output": model.output,
    }
    # A parameter-free skeleton to copy: deepcopy of the full model would copy every weight.
    model.layers = nn.ModuleDict()
    model.tok_embeddings = model.norm = model.output = None
    skeleton = copy.deepcopy(model)
    modules = []
    for s in ids:
        stage = copy.deepcopy(skeleton)
        stage.layers = nn.ModuleDict({str(i): pieces["layers"][str(i)] for i in layers_of[s]})
        if s == 0:
            stage.tok_embeddings = pieces["tok_embeddings"]
        if s == num_stages - 1:
            stage.norm, stage.output = pieces["norm"], pieces["output"]
        modules.append(stage)
    return modules, ids


# ---------------------------------------------------------------------------------------------
# Stages and the schedule


class _Stage(PipelineStage):
    """A PipelineStage that tells its MoE layers which microbatch runs (forced routing) and
    keeps each forward's expert counts (references: train.step_counts gathers them)."""

    def __init__(self, *args, token_offset: Callable[[int], int] | None, **kwargs):
        super().__init__(*args, **kwargs)
        self._token_offset = token_offset
        self.token_counts: list[dict] = []

    def _select(self, microbatch: int) -> None:
        if self._token_offset is not None:
            set_token_offset(self.submod, self._token_offset(microbatch))

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        self._select(fwd_chunk_id)
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        self.token_counts.append(tokens_processed(self.submod))
        return out

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        self._select(bwd_chunk_id)  # activation checkpointing recomputes the routing here
        return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)


@dataclass
class Pipeline:
    """The schedule and this rank's stages; `step` replaces forward + backward."""

    schedule: object
    stages: list[PipelineStage]
    n_microbatches: int
    has_first: bool
    has_last: bool
    group: dist.ProcessGroup
    losses: list = field(default_factory=list)

    @property
    def modules(self) -> list[nn.Module]:
        """This rank's stage modules (parameters, train(), the MoE setters)."""
        return [stage.submod for stage in self.stages]

    def step(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor | None:
        """One step over this rank's local batch (split into microbatches along dim 0).

        Returns the summed microbatch losses (= mean cross-entropy) on the rank holding the
        last stage, a detached tensor with no host sync; None elsewhere.
        """
        self.losses = []
        for stage in self.stages:
            stage.token_counts = []
        args = (tokens_BS,) if self.has_first else ()
        target = labels_BS if self.has_last else None
        self.schedule.step(*args, target=target, losses=self.losses if self.has_last else None)
        if not self.has_last:
            return None
        return torch.stack([loss.detach().double() for loss in self.losses]).sum()

    def loss_to_first_rank(self, loss: torch.Tensor | None, device) -> float:
        """The last stage's loss on every pp rank (a broadcast: call outside the timed region)."""
        value = (
            loss.double().reshape(1)
            if loss is not None
            else torch.zeros(1, device=device, dtype=torch.float64)
        )
        dist.broadcast(value, group_src=dist.get_world_size(self.group) - 1, group=self.group)
        return float(value)


def check_schedule(name: str, virtual_stages: int) -> None:
    if name not in SCHEDULES:
        raise ConfigError(f"trainer.pp_schedule={name!r}: expected one of {', '.join(SCHEDULES)}")
    if virtual_stages < 1:
        raise ConfigError(f"trainer.pp_virtual_stages={virtual_stages} must be >= 1")
    if virtual_stages > 1 and name in SINGLE_STAGE_SCHEDULES:
        raise ConfigError(
            f"trainer.pp_virtual_stages={virtual_stages} needs a multi-stage schedule: set "
            "trainer.pp_schedule=Interleaved1F1B (or trainer.pp_virtual_stages=1)"
        )


def check_rounds(name: str, n_microbatches: int, pp: int) -> None:
    """Interleaved1F1B (torch's flexible variant) runs max(1, n_microbatches // pp) rounds and
    needs n_microbatches to be a multiple of them (pp=2: 2, 3, 4, 6, 8 run; 5, 7 do not)."""
    if name != "Interleaved1F1B":
        return
    rounds = max(1, n_microbatches // pp)
    if n_microbatches % rounds:
        raise ConfigError(
            f"trainer.pp_schedule=Interleaved1F1B needs the micro-batches per rank "
            f"(global_batch/(dp*micro_batch) = {n_microbatches}) to be a multiple of its rounds "
            f"max(1, {n_microbatches} // pp={pp}) = {rounds}; change training.micro_batch or "
            f"training.global_batch (a multiple of pp always works)"
        )


def build_pipeline(
    modules: list[Transformer],
    stage_ids: list[int],
    *,
    pp_group: dist.ProcessGroup,
    num_stages: int,
    schedule: str,
    n_microbatches: int,
    device: torch.device,
    token_offset: Callable[[int], int] | None = None,
) -> Pipeline:
    """Wrap the (already parallelized) stage modules and build the schedule.

    `token_offset(microbatch) -> int`: global token index of this rank's first token in that
    microbatch (forced routing); None when routing is not forced.
    """
    virtual_stages = len(modules)
    check_schedule(schedule, virtual_stages)
    pp = dist.get_world_size(pp_group)
    check_microbatches(n_microbatches, pp)  # the runner's check and message (mesh.py)
    check_rounds(schedule, n_microbatches, pp)
    for module in modules:
        set_aux_loss_grad_scale(module, 1.0 / n_microbatches)

    def loss_fn(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits_BSV, labels_BS) / n_microbatches

    stages = [
        _Stage(m, s, num_stages, device, group=pp_group, token_offset=token_offset)
        for m, s in zip(modules, stage_ids, strict=True)
    ]
    cls = SCHEDULES[schedule]
    common = dict(n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    sched = (
        cls(stages, **common)
        if schedule not in SINGLE_STAGE_SCHEDULES
        else cls(stages[0], **common)
    )
    return Pipeline(
        schedule=sched,
        stages=stages,
        n_microbatches=n_microbatches,
        has_first=0 in stage_ids,
        has_last=num_stages - 1 in stage_ids,
        group=pp_group,
    )


def pipeline(model: Transformer, par, cfg, parallelize: Callable) -> Pipeline:
    """This rank's stages of `model`, each through `parallelize(stage, par, cfg)`, and the
    schedule over them (`par`: parallelize.Parallel, `cfg`: the trainer's Config)."""
    dims, t, tr = par.dims, cfg.training, cfg.trainer
    stages, stage_ids = split_model(
        model,
        pp_rank=par.pp_rank,
        pp=dims.pp,
        virtual_stages=tr.pp_virtual_stages,
        seq_len=t.sequence_length,
    )
    stages = [parallelize(stage, par, cfg) for stage in stages]
    dp_cp_rank = par.dp_cp_rank

    def token_offset(microbatch: int) -> int:
        return dims.token_offset(microbatch, dp_cp_rank, t.micro_batch, t.sequence_length)

    return build_pipeline(
        stages,
        stage_ids,
        pp_group=par.group("pp"),
        num_stages=dims.pp * tr.pp_virtual_stages,
        schedule=tr.pp_schedule,
        n_microbatches=dims.microbatches(t.global_batch, t.micro_batch),
        device=par.device,
        token_offset=token_offset if cfg.routing.forced else None,
    )


# ---------------------------------------------------------------------------------------------
# The train loop's PP step (train.py)


def forward_backward(pipe: Pipeline, microbatches, autocast) -> torch.Tensor | None:
    """train.py's step under PP: this rank's micro-batches [(inputs, labels, positions)] run as
    one pipelined batch (the schedule splits it back along dim 0). Positions are not passed:
    stages default to arange, or to the zig-zag ones under CP (cp.apply_context_parallel)."""
    tokens_BS = torch.cat([mb[0] for mb in microbatches])
    labels_BS = torch.cat([mb[1] for mb in microbatches])
    with autocast:
        return pipe.step(tokens_BS, labels_BS)


def step_metrics(pipe: Pipeline, loss, model: nn.Module, device) -> tuple[torch.Tensor, float]:
    """(mean loss tensor on every pp rank, balance losses summed over all stages).

    Collectives over the pp group (a broadcast and an all-reduce): outside the timed region.
    """
    loss_value = torch.tensor(pipe.loss_to_first_rank(loss, device), device=device)
    aux = torch.tensor([aux_loss_total(model)], dtype=torch.float64, device=device)
    dist.all_reduce(aux, group=pipe.group)
    return loss_value, float(aux)
