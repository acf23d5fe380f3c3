"""All distribution of the single-device model, applied in one place and in a fixed order.

    init_parallel(mesh_dims, device) -> Parallel    once, after init_process_group
    parallelize(model, par, cfg) -> model           one model, or one pipeline stage of it,
                                                    built on the meta device
                                                    (model.build_model(device="meta"), its
                                                    routing installed: routing.py);
                                                    a model already materialized (identical
                                                    on every rank) also works
    clip_grad_norm_(params, max_norm, par)          global norm over FSDP and EP shards

Under pp > 1 the pipeline comes first and wraps this function: pp.pipeline(model, par, cfg,
parallelize) cuts the model into this rank's stages, calls `parallelize` on each and builds the
schedule over them (train.distribute picks one or the other). The train loop reads ranks and
groups from `Parallel` (`rank("dp")`, `dp_cp_rank`, `group("dp_cp")`, ...) and sets the
forced-routing token offset per micro-batch (moe.set_token_offset, MeshDims.token_offset).

Order in `parallelize` (each step sees the model the previous one left):
  1. expert parallel       slice expert weights to this rank's experts; all-to-all dispatchers
  2. materialize           a meta model: allocate what is left on the device and initialise
                           it from training.seed (model.materialize); its values are this
                           rank's slices of the one-process model, and building never holds
                           more than this rank's layers and experts (before FSDP shards them)
  3. context parallel      cp.py, when mesh.cp > 1
  4. balance-loss sums     the router statistics summed over dp*cp (global-batch loss) or cp
                           (sequence loss), injected into the MoE layers
  5. activation checkpointing, then compile (per block)
  6. FSDP2                 experts over edp, everything else over dp*cp; when dp*cp = 1 no
                           FSDP, and under dtype=bf16 (fp8 with trainer.fp8_master_weights)
                           bf16 compute weights over fp32 masters instead
                           (precision.MasterWeights: what FSDP's mixed precision does)

Mesh layout. Global rank = pp_i * (dp*cp) + dp_i * cp + cp_i, i.e. a DeviceMesh
("pp", "dp", "cp"). Expert parallel is folded into the flattened dp*cp dimension ("dp_cp"):
EP groups are contiguous blocks of `ep` ranks in it, and the experts' data-parallel degree
edp = dp*cp/ep is the other factor, a mesh ("edp", "ep") over the same ranks.

Gradients. FSDP averages non-expert gradients over dp*cp, which is the gradient of the mean loss
over the global batch when every rank's loss is a mean over the same number of tokens. An
expert shard's gradient already sums the contributions of its whole EP group (the all-to-all's
backward brings them home), so FSDP sums it over edp and divides by dp*cp, not by edp
(`set_gradient_divide_factor`). Accumulating micro-batches is plain autograd accumulation into
the sharded gradients (the loss of each micro-batch scaled by 1/micro-batches).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from moe_perf.common.mesh import MeshDims
from moe_perf.trainer.cp import apply_context_parallel
from moe_perf.trainer.ep import apply_expert_parallel
from moe_perf.trainer.model import materialize
from moe_perf.trainer.moe import moe_layers
from moe_perf.trainer.precision import MasterWeights

# Gradients are reduced in fp32 even when parameters are gathered in bf16: a bf16 sum over many
# ranks loses the small gradients (torchtitan's default too).
REDUCE_DTYPE = torch.float32


@dataclass
class Parallel:
    """The device meshes and the process groups the train loop, the model and the tests use.

    With one process and no process group (unit tests), every mesh is None, every group None
    and every rank 0.
    """

    dims: MeshDims
    device: torch.device
    world_mesh: DeviceMesh | None = None  # ("pp", "dp", "cp")
    dp_cp_mesh: DeviceMesh | None = None  # ("dp_cp",): this pipeline stage's data x context
    expert_mesh: DeviceMesh | None = None  # ("edp", "ep"): the same ranks, EP blocks contiguous

    def _mesh_of(self, name: str) -> DeviceMesh | None:
        if name in ("pp", "dp", "cp"):
            return self.world_mesh
        if name == "dp_cp":
            return self.dp_cp_mesh
        if name in ("edp", "ep"):
            return self.expert_mesh
        raise KeyError(f"no mesh dimension {name!r}: pp, dp, cp, dp_cp, edp or ep")

    def mesh(self, name: str) -> DeviceMesh | None:
        m = self._mesh_of(name)
        return None if m is None else (m if m.mesh_dim_names == (name,) else m[name])

    def group(self, name: str) -> dist.ProcessGroup | None:
        m = self._mesh_of(name)
        return None if m is None else m.get_group(name)

    def rank(self, name: str) -> int:
        m = self._mesh_of(name)
        return 0 if m is None else m.get_local_rank(name)

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def dp_cp_rank(self) -> int:
        return self.rank("dp_cp")

    @property
    def ep_rank(self) -> int:
        return self.rank("ep")

    @property
    def pp_rank(self) -> int:
        return self.rank("pp")


def init_parallel(dims: MeshDims, device: torch.device | str) -> Parallel:
    """Build the meshes (a collective: every rank calls it, after init_process_group)."""
    device = torch.device(device)
    dims.check_layout()
    if not dist.is_initialized():
        if dims.world != 1:
            raise RuntimeError(f"mesh world size {dims.world} needs torch.distributed initialised")
        return Parallel(dims, device)
    if dist.get_world_size() != dims.world:
        raise RuntimeError(
            f"process group has {dist.get_world_size()} ranks but the mesh needs {dims.world} "
            f"(mesh.nnodes * mesh.nproc_per_node)"
        )
    world_mesh = init_device_mesh(
        device.type, (dims.pp, dims.dp, dims.cp), mesh_dim_names=("pp", "dp", "cp")
    )
    dp_cp_mesh = world_mesh["dp", "cp"]._flatten("dp_cp")
    return Parallel(dims, device, world_mesh, dp_cp_mesh, _expert_mesh(dims, device, dp_cp_mesh))


def _expert_mesh(dims: MeshDims, device: torch.device, dp_cp_mesh: DeviceMesh) -> DeviceMesh:
    """("edp", "ep") over this stage's dp*cp ranks: EP blocks of `ep` consecutive dp_cp ranks."""
    if hasattr(dp_cp_mesh, "_unflatten"):
        return dp_cp_mesh._unflatten(0, (dims.edp, dims.ep), ("edp", "ep"))
    # Older torch (no _unflatten): a second root mesh with the same rank order, global rank =
    # pp_i * dp_cp + edp_i * ep + ep_i, whose ("edp", "ep") submesh is the same layout.
    mesh = init_device_mesh(
        device.type, (dims.pp, dims.edp, dims.ep), mesh_dim_names=("pp", "edp", "ep")
    )
    return mesh["edp", "ep"]


def parallelize(model: nn.Module, par: Parallel, cfg) -> nn.Module:
    """Expert parallel, materialization, context parallel, balance-loss sums, activation
    checkpointing, compile and FSDP, in that order, on one model or pipeline stage."""
    dims = par.dims
    if dims.ep > 1:
        apply_expert_parallel(model, par.group("ep"))
    materialize_if_meta(model, par.device, cfg)
    if dims.cp > 1:
        apply_context_parallel(model, par.group("cp"))
    inject_balance_reductions(model, par)
    if cfg.trainer.activation_checkpointing == "full":
        apply_activation_checkpointing(model)
    if cfg.trainer.compile:
        for block in model.layers.values():
            block.compile()  # not fullgraph: uneven all-to-all needs its split sizes on the host
    # One data x context rank: nothing to shard. FSDP would still copy every parameter in and
    # every gradient out per micro-batch (on one H200 about 40% of a 4-layer qwen3-30b-a3b
    # step); bf16 compute then comes from bf16 weights over fp32 masters (precision.py), which
    # cast once a step where autocast would cast in every micro-batch.
    if dist.is_initialized() and dims.dp_cp > 1:
        apply_fsdp(model, par, mixed_precision(cfg, par.device))
    elif cfg.master_weights:
        # bf16, and fp8 with trainer.fp8_master_weights: torchao's Float8Linear casts the bf16
        # copies to fp8 itself (otherwise fp8 keeps autocast over fp32 weights)
        model.master_weights = MasterWeights(
            model, torch.bfloat16, keep_fp32=(getattr(model, "tok_embeddings", None),)
        )
    return model


def materialize_if_meta(model: nn.Module, device: torch.device, cfg) -> None:
    """Allocate a meta-device model part on `device` and initialise it from training.seed and
    trainer.init_std (model.materialize); a part already on a device is left as it is."""
    on_meta = [p.is_meta for p in model.parameters()] + [b.is_meta for b in model.buffers()]
    if not any(on_meta):
        return
    if not all(on_meta):
        raise ValueError("parallelize: the model is partly on the meta device")
    materialize(model, device, seed=cfg.training.seed, init_std=cfg.trainer.init_std)


class GroupSum:
    """balance.Reduction over a process group: an in-place all_reduce (a collective)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group, self.size = group, dist.get_world_size(group)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t


def inject_balance_reductions(model: nn.Module, par: Parallel) -> None:
    """The ranks a balance loss's statistics span: the global-batch loss counts experts over
    the data x context group; the sequence loss over the cp group (a sequence spans it)."""
    groups = {"global-batch": ("dp_cp", par.dims.dp_cp), "sequence": ("cp", par.dims.cp)}
    for m in moe_layers(model):
        name, size = groups[m.load_balance]
        m.balance_reduction = GroupSum(par.group(name)) if size > 1 else None


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward (before compile and FSDP wrap it)."""
    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)


def mixed_precision(cfg, device: torch.device) -> MixedPrecisionPolicy:
    """bf16 parameters in compute with fp32 reduction on GPU for bf16/fp8; fp32 otherwise."""
    if device.type != "cpu" and cfg.dtype.bf16_compute:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=REDUCE_DTYPE)
    return MixedPrecisionPolicy()


def apply_fsdp(model: nn.Module, par: Parallel, mp: MixedPrecisionPolicy) -> None:
    """fully_shard bottom-up: experts (edp), blocks, embedding, norm+head, root (dp*cp).

    With one rank per expert shard (edp = 1, e.g. ep8 on 8 GPUs) the experts are left out of
    FSDP: it would copy every expert weight in and every gradient out per micro-batch for
    nothing to shard (on one H200 FSDP over one rank cost the experts of a qwen3-30b-a3b
    layer 22 ms per step). They stay fp32 parameters (autocast casts them in GroupedExperts),
    and a gradient hook applies the 1/(dp*cp) that FSDP's divide factor would.
    """
    dp_cp_mesh, edp_mesh = par.dp_cp_mesh, par.mesh("edp")
    edp = par.dims.edp

    def expert_placement(param: nn.Parameter):
        # Fewer local experts than edp ranks: shard the hidden dim instead of padding dim 0.
        return Shard(0) if param.shape[0] >= edp else Shard(1)

    unsharded: set[nn.Parameter] = set()
    for block in model.layers.values():
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        block_unsharded: set[nn.Parameter] = set()
        if getattr(inner, "moe_enabled", False):
            experts = inner.ffn.experts
            if edp == 1:
                block_unsharded = set(experts.parameters())
                scale_gradients_(block_unsharded, 1.0 / par.dims.dp_cp)
            else:
                fully_shard(
                    experts, mesh=edp_mesh, mp_policy=mp, shard_placement_fn=expert_placement
                )
                experts.set_gradient_divide_factor(float(par.dims.dp_cp))
                if par.device.type == "cpu":
                    # Gloo has no PREMUL_SUM: sum, then divide on the shard.
                    experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=dp_cp_mesh, mp_policy=mp, ignored_params=block_unsharded or None)
        unsharded |= block_unsharded
    if getattr(model, "tok_embeddings", None) is not None:
        fully_shard(model.tok_embeddings, mesh=dp_cp_mesh, mp_policy=mp)
    head = [m for m in (getattr(model, "norm", None), getattr(model, "output", None)) if m]
    if head:
        # Backward starts here: keep the head gathered between forward and backward.
        fully_shard(head, mesh=dp_cp_mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=dp_cp_mesh, mp_policy=mp, ignored_params=unsharded or None)


def scale_gradients_(params, factor: float) -> None:
    """Multiply every gradient reaching `params` by `factor` (before accumulation, so it holds
    across micro-batches)."""
    for p in params:
        p.register_hook(lambda grad, f=factor: grad * f)


def optimizer_param_groups(params: list[nn.Parameter]) -> list[dict]:
    """DTensor (FSDP-sharded) and plain parameters in separate groups: foreach and fused
    optimizer kernels refuse lists that mix the two."""
    sharded = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    return [{"params": group} for group in (sharded, plain) if group]


# --------------------------------------------------------------------------------------------
# Helpers for the train loop


def _local_grads(params) -> list[torch.Tensor]:
    grads = [p.grad for p in params if p.grad is not None]
    return [g.to_local() if isinstance(g, DTensor) else g for g in grads]


@torch.no_grad()
def grad_norm(params, par: Parallel) -> torch.Tensor:
    """Global gradient 2-norm over every rank's shards (experts and non-experts).

    Each gradient element lives on exactly one rank of dp*cp (FSDP shards over dp*cp; expert
    shards over edp x ep = dp*cp) and on one pipeline stage, so the squared norm is the sum of
    local squares all-reduced over dp_cp and pp. torch's clip_grad_norm_ cannot mix DTensors of
    the edp and dp_cp meshes. One small all_reduce per group; no host sync.
    """
    local = _local_grads(params)
    if local:
        # One multi-tensor pass (fp32 accumulation) instead of a pow and a sum per tensor.
        norms = torch._foreach_norm(local, 2.0, dtype=torch.float32)
        total_sq = torch.stack(norms).pow(2).sum()
    else:
        total_sq = torch.zeros((), device=par.device)
    for name in ("dp_cp", "pp"):
        group = par.group(name)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total_sq, group=group)
    return total_sq.sqrt()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What clipping multiplies every gradient by: min(1, max_norm / norm) (on the device)."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, par: Parallel) -> torch.Tensor:
    """Global gradient norm (`grad_norm`), then every gradient scaled to at most `max_norm`
    (no host sync: the scale stays on the device). Returns the norm before clipping."""
    norm = grad_norm(params, par)
    if max_norm > 0:
        torch._foreach_mul_(_local_grads(params), clip_coefficient(norm, max_norm))
    return norm
