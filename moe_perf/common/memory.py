"""Peak memory of one rank of the reference trainer, estimated from its config before launch.

What one rank holds (moe_perf/trainer: fp32 parameters, FSDP2 over dp*cp for everything but the
experts, experts sliced by ep and sharded over edp = dp*cp/ep, fused AdamW with two fp32
states, gradients set to None between steps):

* weights      4 B per local parameter (fp32 masters), plus bf16 copies: outside FSDP the
               bf16 compute weights (`Config.master_weights`: dtype=bf16, or fp8 with
               trainer.fp8_master_weights, on one data x context rank: trainer/precision.py)
               or those autocast and the experts' cast keep for backward (fp8), inside FSDP
               one layer's all-gathered bf16 parameters;
* gradients    4 B per local parameter, and with bf16 compute weights outside FSDP the bf16
               gradient of the largest parameter, alive until its hook adds it in;
* optimizer    8 B per local parameter (AdamW exp_avg and exp_avg_sq);
* activations  what autograd saves per layer and micro-batch (`layer_activation_bytes`:
               eager, or what a compiled block's graphs keep, a smaller set), for the
               micro-batches in flight (1; under pp > 1 up to pp for 1F1B, all for GPipe);
               with activation checkpointing only each block's input, plus one layer
               recomputed; under routing=skew with ep > 1 the experts' side (the dispatched
               rows and the expert matmuls' outputs) at the busiest EP rank's share of the
               slots (`received_share`);
* logits       the [tokens x vocab] tensors alive at the loss's backward (`logits_bytes`: three
               fp32 ones eager, two in the compute dtype compiled, one on CUDA without
               pipeline stages, whose Triton loss writes the gradient over the logits), on the
               last pipeline stage;
* runtime      what the process holds besides tensors: Python with torch loaded on a CPU (its
               RSS), the CUDA context and library workspaces on a GPU.

Peak: gradients and activations overlap in backward; with one micro-batch the gradients grow
as the activations are freed (the larger of the two counts), with several the first
micro-batch's gradients stay while the next runs (both count). The worst pipeline stage is
the one reported. The peak is of tensors (what torch's allocator counts as allocated, plus
`runtime`); the caching allocator reserves more than that (on one H200 the reserved peaks of
the bench configs were 1-3% above this estimate at micro-batch 8, 8-13% at micro-batch 16).
Checked against measured peaks on CPU in tests/test_memory.py and on the GPU by
bench/bench_memory.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_perf.common.config import Config, ModelConfig, skew_plan_of
from moe_perf.common.mesh import MeshDims

GIB = 2**30
RUNTIME_BYTES = {"cpu": 0.35 * GIB, "cuda": 1.0 * GIB}


@dataclass(frozen=True)
class LayerParams:
    """Parameter counts of one decoder layer, split by how they are sharded."""

    dense: int  # attention, norms, router, shared or dense FFN: FSDP over dp*cp
    experts: int  # routed experts, all of them: sliced by ep, FSDP over edp


def attention_params(m: ModelConfig) -> int:
    """Weights of the q, k, v and o projections of one layer (also the FLOP model's count)."""
    v_dim = m.v_head_dim or m.head_dim
    return (
        m.hidden * (m.num_heads * m.head_dim + m.num_kv_heads * (m.head_dim + v_dim))
        + m.num_heads * v_dim * m.hidden
    )


def layer_params(m: ModelConfig, layer: int) -> LayerParams:
    # the projections, the two RMSNorms and, with QK-norm, its two head_dim weights
    attention = attention_params(m) + 2 * m.hidden + (2 * m.head_dim if m.qk_norm else 0)
    if layer < m.dense_layers:
        return LayerParams(attention + 3 * m.hidden * m.dense_ffn, 0)
    shared = 3 * m.hidden * m.num_shared_experts * m.shared_expert_ffn
    shared += m.hidden if m.shared_expert_gate and shared else 0
    router = m.hidden * m.num_experts + (m.num_experts if m.router_bias else 0)
    return LayerParams(attention + router + shared, 3 * m.num_experts * m.hidden * m.expert_ffn)


def layer_activation_bytes(
    m: ModelConfig, layer: int, tokens: int, b: int, compiled: bool = False, r: int = 4,
    received: float = 1.0,
) -> int:  # fmt: skip
    """Bytes autograd saves for one layer's backward at `tokens` tokens per rank; `b` = bytes
    of the compute dtype, `r` of the residual stream and the norms' outputs (fp32 under
    autocast over fp32 parameters, bf16 with bf16 compute weights). `compiled`: the block
    under torch.compile, which saves a different set. `received`: the slots this rank's
    experts process over the T*K its tokens send (1 when routing is balanced)."""
    if compiled:
        return compiled_layer_bytes(m, layer, tokens, b, r, received)
    T, D, vd = tokens, m.hidden, m.v_head_dim or m.head_dim
    qkv = m.num_heads * m.head_dim + m.num_kv_heads * (m.head_dim + vd)
    rot = m.head_dim * m.rope_fraction
    # attention: residual in, norm out and its cast; q/k/v out, after QK-norm, after RoPE (with
    # its fp32 halves); SDPA's output and log-sum-exp; wo's input and output
    attn = r * T * D * 2 + b * T * D + b * T * qkv * (3 if m.qk_norm else 2)
    attn += 4 * T * (m.num_heads + m.num_kv_heads) * rot + 4 * T * m.num_heads
    attn += 2 * b * T * m.num_heads * vd + b * T * D
    ffn_in = r * T * D * 2 + b * T * D  # residual, norm out, cast
    if layer < m.dense_layers:
        return attn + ffn_in + 4 * b * T * m.dense_ffn + b * T * D
    N, F = T * m.top_k, m.expert_ffn
    Nr = round(N * received)  # slots on the experts' side of the dispatch
    router = 2 * 4 * T * m.num_experts + 12 * T * m.top_k  # fp32 logits, scores; ids, weights
    # routed: permuted rows (fp32 and their cast), w1 and w3 out, SwiGLU's two intermediates,
    # w2 out (the experts' side), combined rows and their weighted product (the tokens' side)
    routed = (4 + b) * Nr * D + 4 * b * Nr * F + b * Nr * D + 2 * b * N * D
    shared_ffn = m.num_shared_experts * m.shared_expert_ffn
    shared = 4 * b * T * shared_ffn + b * T * D if shared_ffn else 0
    return attn + ffn_in + router + routed + shared


def compiled_layer_bytes(m: ModelConfig, layer: int, tokens: int, b: int, r: int = 4,
                         received: float = 1.0) -> int:  # fmt: skip
    """What a compiled block saves: the tensors AOTAutograd's partitioner keeps between the
    forward and backward graphs (read off their signatures, TORCH_LOGS=aot_graphs, on a block
    of qwen3-30b-a3b's proportions, of gpt-oss's and of deepseek-v2-lite's). It recomputes
    the cheap elementwise work (norms, SwiGLU's pieces, casts, the fp32 gather of routed rows)
    from the tensors below instead of keeping it, which is most of the saving over eager.
    Assumes a fused SDPA kernel (flash/cuDNN: no S x S scores), as on the GPU."""
    T, D, E, K = tokens, m.hidden, m.num_experts, m.top_k
    H, G, d, vd = m.num_heads, m.num_kv_heads, m.head_dim, m.v_head_dim or m.head_dim
    # attention: the residual (r bytes) in and after attention (the two norms' inputs), the first
    # norm's cast, q/k/v as projected, q and k after QK-norm and RoPE (SDPA's inputs; without
    # QK-norm only these, not the projected ones), SDPA's output and log-sum-exp, and wo's
    # input (a contiguous copy of the output's transpose)
    attn = 2 * r * T * D + b * T * D + b * T * (H * d + G * (d + vd))
    attn += b * T * (H + G) * d if m.qk_norm else 0
    attn += 2 * b * T * H * vd + 4 * T * H
    if layer < m.dense_layers:
        return attn + b * T * D + 3 * b * T * m.dense_ffn  # norm's cast; w1, w3, SwiGLU out
    N, F = T * K, m.expert_ffn
    Nr = round(N * received)  # slots on the experts' side of the dispatch
    # the norm's cast (the routed rows are gathered again from it in backward), fp32 scores,
    # int64 ids and fp32 gating weights, the slots' sort order and its inverse (int64)
    router = b * T * D + 4 * T * E + 12 * T * K + 16 * N
    # routed rows in the compute dtype and w2's output; w1 and w3 out and SwiGLU's output (all
    # on the experts' side of the dispatch)
    routed = 2 * b * Nr * D + 3 * b * Nr * F
    shared = 3 * b * T * m.num_shared_experts * m.shared_expert_ffn
    return attn + router + routed + shared


def logits_bytes(m: ModelConfig, tokens: int, b: int, compiled: bool, fused: bool = False) -> int:
    """The loss's peak at its backward, [tokens x vocab] tensors (model.cross_entropy).

    Eager: the head's output is not kept (its fp32 upcast is a new tensor, and log-softmax
    keeps its own output); in backward log-softmax's fp32 output, nll's fp32 gradient and
    log-softmax's fp32 gradient are alive together: 12 B each. Compiled (train.py compiles the
    loss with the blocks): upcast and log-softmax are fused, the graph keeps the head's output
    in the compute dtype and its backward writes one gradient of that dtype: 2b. `fused` (the
    Triton loss, trainer/loss.py, on CUDA): the logits, then their gradient in the same
    buffer: b."""
    if fused:
        return b * tokens * m.vocab_size
    return (2 * b if compiled else 12) * tokens * m.vocab_size


@dataclass(frozen=True)
class MemoryEstimate:
    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    runtime: float
    overlap: bool  # gradients and activations both at their peak (several micro-batches)

    @property
    def total(self) -> float:
        dynamic = self.gradients + self.activations + self.logits
        if not self.overlap:
            dynamic = max(self.gradients, self.activations + self.logits)
        return self.weights + self.optimizer + dynamic + self.runtime

    @property
    def tensors(self) -> float:
        """The peak less `runtime`: what torch's allocator reports as max allocated."""
        return self.total - self.runtime

    def gib(self) -> float:
        return self.total / GIB

    def breakdown(self) -> str:
        parts = ("weights", "gradients", "optimizer", "activations", "logits", "runtime")
        shown = ", ".join(f"{p} {getattr(self, p) / GIB:.1f}" for p in parts)
        return f"{self.gib():.1f} GiB per rank ({shown} GiB)"


def received_share(cfg: Config) -> float:
    """Slots the busiest EP rank's experts process over the T*K its tokens send: the skew
    plan's rank imbalance (every rank of an EP group sends the same counts, common/routing.py);
    1 under balance, and under routing=real, whose counts are not known before the run."""
    dims = cfg.mesh_dims
    if cfg.routing.mode != "skew" or dims.ep == 1:
        return 1.0
    return skew_plan_of(cfg.routing, cfg.model, dims, cfg.training).rank_imbalance


def bf16_copies(counts: list, dense: float, experts: float, dims: MeshDims) -> float:
    """Bytes of the bf16 weight copies kept for backward: all of a part's outside FSDP (its
    `dense` parameters, the embedding's lookup left out), else one gathered layer; the experts'
    own unless EP's data-parallel groups shard them."""
    if dims.dp_cp > 1:  # FSDP
        copies = 2 * 2 * max((c.dense + c.experts / dims.ep for c in counts), default=0)
    else:
        copies = 2 * dense
    return copies + (2 * experts / dims.ep if dims.edp == 1 else 0)


def estimate(cfg: Config, device: str) -> MemoryEstimate:
    """The worst rank's peak, in bytes, of the reference trainer with `cfg` on `device`
    ("cpu" or "cuda")."""
    m, t, dims = cfg.model, cfg.training, cfg.mesh_dims
    b = 2 if cfg.dtype.bf16_compute else 4
    compiled = cfg.trainer.compile
    tokens = t.micro_batch * t.sequence_length // dims.cp
    n_micro = t.global_batch // (dims.dp * t.micro_batch)
    in_flight = 1
    if dims.pp > 1:
        in_flight = n_micro if cfg.trainer.pp_schedule == "GPipe" else min(n_micro, dims.pp)
    fsdp = dims.dp_cp > 1
    # bf16 compute weights over fp32 masters (parallelize.py): a bf16 residual stream
    r = 2 if cfg.master_weights else 4
    dense_shard = dims.dp_cp if fsdp else 1
    expert_shard = dims.ep * (dims.edp if dims.edp > 1 else 1)
    received = received_share(cfg)

    per_stage = math.ceil(m.num_layers / dims.pp)
    stages = []
    for first_stage, last_stage in ((True, dims.pp == 1), (False, True)):
        if not first_stage and dims.pp == 1:
            continue
        start = 0 if first_stage else m.num_layers - per_stage
        layers = range(start, min(start + per_stage, m.num_layers))
        counts = [layer_params(m, i) for i in layers]
        embedding = m.vocab_size * m.hidden if first_stage else 0  # a lookup: never cast
        dense = sum(c.dense for c in counts) + embedding
        dense += m.vocab_size * m.hidden + m.hidden if last_stage else 0
        experts = sum(c.experts for c in counts)
        local = dense / dense_shard + experts / expert_shard
        copies = bf16_copies(counts, dense - embedding, experts, dims) if b == 2 else 0.0
        saved = [layer_activation_bytes(m, i, tokens, b, compiled, r, received) for i in layers]
        if cfg.trainer.activation_checkpointing == "full":
            acts = len(saved) * 4 * tokens * m.hidden * in_flight + max(saved, default=0)
        else:
            acts = sum(saved) * in_flight
        # the Triton loss runs on CUDA where no pipeline schedule computes the loss
        fused = device == "cuda" and dims.pp == 1
        logits = logits_bytes(m, tokens, b, compiled, fused) if last_stage else 0
        # bf16 compute weights outside FSDP: a parameter's bf16 gradient lives until its hook
        # has added it into the fp32 one, the largest at once (an experts' w13, or the head)
        transient = 0.0
        if b == 2 and not fsdp:
            w13 = max((2 * c.experts / 3 / dims.ep for c in counts), default=0)
            transient = 2 * max(w13, m.vocab_size * m.hidden if last_stage else 0)
        stages.append(
            MemoryEstimate(
                weights=4 * local + copies,
                gradients=4 * local + transient,
                optimizer=8 * local,
                activations=acts,
                logits=logits,
                runtime=RUNTIME_BYTES[device],
                overlap=n_micro > 1,
            )
        )
    return max(stages, key=lambda e: e.total)
