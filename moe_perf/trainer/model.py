"""Single-device decoder-only MoE transformer built from a model config.

Embedding -> layers (RMSNorm, GQA attention with RoPE (attention.py), RMSNorm, dense SwiGLU
(layers.py) or MoE (moe.py)) -> RMSNorm -> untied head. Distribution (EP, FSDP, PP, CP, compile)
is applied from outside in parallelize.py: layers live in a ModuleDict keyed by index so a
pipeline stage can drop layers and keep parameter names, `tok_embeddings`/`norm`/`output` may be
set to None on middle stages, and `Attention.attend` can be replaced by a context-parallel
attention.

Initialisation is per unit (the embedding, each layer by its global id, the final norm, the
head), each from its own seeded stream, and per routed expert within a layer
(`Transformer.init_weights`): a parameter's values do not depend on which other layers or
experts exist in the process. So the trainer builds the model on the meta device, lets
parallelize.py drop other stages' layers and other EP ranks' experts, and only then allocates
and initialises what is left (`materialize`): every rank holds exactly its slices of the model
that one process builds from the same seed, and never the whole model.

Shapes: the trainer's legend (moe_perf/trainer/__init__.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moe_perf.common.config import ModelConfig
from moe_perf.trainer.attention import Attention, rope_cos_sin, rotary_dims
from moe_perf.trainer.layers import FeedForward, RMSNorm, init_generator
from moe_perf.trainer.moe import MoE


class Block(nn.Module):
    def __init__(self, m: ModelConfig, layer_id: int, force_balance: bool, balance_ep: int):
        super().__init__()
        self.attention_norm = RMSNorm(m.hidden, m.norm_eps)
        self.attention = Attention(m)
        self.ffn_norm = RMSNorm(m.hidden, m.norm_eps)
        self.moe_enabled = layer_id >= m.dense_layers
        if self.moe_enabled:
            self.ffn = MoE(
                m.hidden,
                m.num_experts,
                m.top_k,
                m.expert_ffn,
                router=m.router,
                norm_topk_prob=m.norm_topk_prob,
                router_bias=m.router_bias,
                num_shared_experts=m.num_shared_experts,
                shared_expert_ffn=m.shared_expert_ffn,
                shared_expert_gate=m.shared_expert_gate,
                swiglu_clamp=m.swiglu_clamp,
                load_balance=m.load_balance,
                load_balance_coeff=m.load_balance_coeff,
                force_balance=force_balance,
                balance_ep=balance_ep,
                layer_id=layer_id,
            )
        else:
            self.ffn = FeedForward(m.hidden, m.dense_ffn, m.swiglu_clamp)

    def init_weights(self, std: float, out_std: float, generator=None) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(std, out_std, generator)
        self.ffn.init_weights(std, out_std, generator)

    def forward(self, x_BSD: torch.Tensor, rope: tuple | None) -> torch.Tensor:
        h_BSD = x_BSD + self.attention(self.attention_norm(x_BSD), rope)
        return h_BSD + self.ffn(self.ffn_norm(h_BSD))


class Transformer(nn.Module):
    """model(tokens_BS, positions_BS=None) -> logits_BSV.

    On a middle pipeline stage (tok_embeddings None) the input is hidden states x_BSD; on a
    stage without `output` the result is hidden states.
    """

    def __init__(self, m: ModelConfig, force_balance: bool = False, balance_ep: int = 1):
        super().__init__()
        self.config = m
        self.tok_embeddings = nn.Embedding(m.vocab_size, m.hidden)
        self.layers = nn.ModuleDict(
            {str(i): Block(m, i, force_balance, balance_ep) for i in range(m.num_layers)}
        )
        self.norm = RMSNorm(m.hidden, m.norm_eps)
        self.output = nn.Linear(m.hidden, m.vocab_size, bias=False)

    def init_units(self) -> list[tuple[int, nn.Module]]:
        """(unit index, module) for the init units this module holds: tok_embeddings 0, layer
        i 1 + i (its GLOBAL id: a pipeline stage keeps the full model's layer keys), norm L + 1,
        output L + 2, with L the full model's layer count."""
        L = self.config.num_layers
        units = [(0, self.tok_embeddings)]
        units += [(1 + int(i), block) for i, block in self.layers.items()]
        units += [(L + 1, self.norm), (L + 2, self.output)]
        return [(u, module) for u, module in units if module is not None]

    @torch.no_grad()
    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Normal(0, std) everywhere; residual output projections scaled by 1/sqrt(2*layers)
        (GPT-2); the head by 1/sqrt(hidden); norms one; the embedding Normal(0, 1).

        Unit u draws from its own generator on the unit's device, seeded from (seed, u), and
        routed expert e of a layer from (that seed, weight, e) (experts.GroupedExperts): the values
        of a unit do not depend on the other units, nor an expert's on the other experts, so a
        pipeline stage or an EP rank gets exactly its part of the model one process builds.
        The global RNG is not used. The values depend on the device type: CPU and CUDA
        generators give different streams for one seed.
        """
        out_std = std / math.sqrt(2 * max(1, self.config.num_layers))
        for u, unit in self.init_units():
            gen = init_generator(next(unit.parameters()).device, seed, u)
            if unit is self.tok_embeddings:
                nn.init.normal_(unit.weight, std=1.0, generator=gen)
            elif unit is self.norm:
                unit.init_weights()
            elif unit is self.output:
                nn.init.trunc_normal_(unit.weight, std=self.config.hidden**-0.5, generator=gen)
            else:
                unit.init_weights(std, out_std, gen)

    def rope_tables(self, positions_BS: torch.Tensor) -> tuple | None:
        """(cos, sin) [B, 1, S, R/2] in fp32 for every layer, or None without RoPE. Built once
        per forward, outside the compiled blocks: inside, inductor fused the table into each
        layer's RoPE kernel and recomputed sin and cos for every element of q and k (11.6 of
        the 4-layer bench's 500 ms a step on one H200)."""
        m = self.config
        rot_dims = rotary_dims(m.head_dim, m.rope_fraction)
        return rope_cos_sin(positions_BS, rot_dims, m.rope_theta) if rot_dims else None

    def forward(self, tokens_BS: torch.Tensor, positions_BS: torch.Tensor | None = None):
        h_BSD = self.tok_embeddings(tokens_BS) if self.tok_embeddings is not None else tokens_BS
        if positions_BS is None:
            B, S = h_BSD.shape[:2]
            positions_BS = torch.arange(S, device=h_BSD.device).expand(B, S)
        rope = self.rope_tables(positions_BS)
        for block in self.layers.values():
            h_BSD = block(h_BSD, rope)
        if self.norm is not None:
            h_BSD = self.norm(h_BSD)
        return self.output(h_BSD) if self.output is not None else h_BSD


def build_model(
    m: ModelConfig,
    *,
    seed: int,
    force_balance: bool,
    balance_ep: int = 1,
    device: torch.device | str = "cpu",
    init_std: float = 0.02,
) -> Transformer:
    """The full model, initialised from `seed` on `device`: identical on every rank.

    device="meta": the uninitialised model, no memory allocated (`seed` and `init_std` unused);
    parallelize.py cuts it to this rank's part and calls `materialize` with the same seed.
    """
    with torch.device("meta"):
        model = Transformer(m, force_balance=force_balance, balance_ep=balance_ep)
    if torch.device(device).type != "meta":
        materialize(model, device, seed=seed, init_std=init_std)
    return model


def materialize(
    model: Transformer, device: torch.device | str, *, seed: int, init_std: float = 0.02
) -> None:
    """Allocate a meta-device model (or a pipeline stage of one, or one with EP-sliced experts)
    on `device` and initialise it from `seed`: the values of the full model's same parameters
    (or slices). Allocates only what the module holds."""
    model.to_empty(device=device)
    model.init_weights(seed, init_std)


def cross_entropy(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, computed in fp32."""
    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), labels_BS.flatten())
