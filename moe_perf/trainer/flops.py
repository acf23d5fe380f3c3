"""Model FLOPs per token, the peak table, and MFU.

Formula (what the reference trainer computes; stated so numbers can be compared):

  flops_per_token = 6 * N_matmul + 3 * L * H * (Dh + Dv) * S

* N_matmul: the weights of every matmul a token passes through, ACTIVE experts only: attention
  projections q, k, v, o; the router (D x E); K routed experts and the shared experts
  (3 * D * F each, SwiGLU); dense leading FFNs; the output head (D x V). The embedding lookup,
  norms, RoPE and softmax are not counted. 6 = 2 (multiply-add) x 3 (forward + backward for
  inputs and weights): Kaplan et al. 2020, as in Megatron-LM and PaLM's MFU.
* Attention scores and values: forward 2*S*Dh (QK^T) + 2*S*Dv (AV) per query per head, halved
  because attention is causal (NVIDIA's convention; torchtitan counts full attention and reads
  ~20% higher on these models), times 3 for training. S is the full sequence length (under
  context parallel too).
* Recomputation under activation checkpointing is NOT counted (model FLOPs, not hardware FLOPs).
* Approximated architectures count what is computed (e.g. MLA as plain attention).

TFLOP/s per GPU = flops_per_token * tokens_per_s / world / 1e12; MFU = that / peak, with the
dense bf16 peak of the GPU; None on CPU, unknown GPUs and fp8 (no single peak for mixed fp8/bf16).
"""

from __future__ import annotations

from moe_perf.common.config import ModelConfig
from moe_perf.common.memory import attention_params

# Dense (no sparsity) bf16 tensor-core peak, FLOP/s, from NVIDIA's datasheets.
PEAK_BF16_FLOPS = (
    ("H200", 989.5e12),
    ("H100 PCIe", 756.0e12),
    ("H100", 989.5e12),  # SXM
    ("A100", 312.0e12),
)


def ffn_params_per_token(m: ModelConfig, layer_id: int) -> int:
    """Weights one token's FFN matmuls read in layer `layer_id`: the dense FFN, or the router,
    K routed experts, the shared experts and their sigmoid gate."""
    if layer_id < m.dense_layers:
        return 3 * m.hidden * m.dense_ffn
    return (
        m.hidden * m.num_experts
        + 3 * m.hidden * (m.top_k * m.expert_ffn + m.num_shared_experts * m.shared_expert_ffn)
        + (m.hidden if m.num_shared_experts and m.shared_expert_gate else 0)
    )


def head_params(m: ModelConfig) -> int:
    return m.hidden * m.vocab_size


def matmul_params_per_token(m: ModelConfig) -> int:
    layers = sum(attention_params(m) + ffn_params_per_token(m, i) for i in range(m.num_layers))
    return layers + head_params(m)


def attention_core_flops(m: ModelConfig, seq_len: int) -> int:
    """Forward FLOPs of QK^T and AV per token and layer, causal counted half:
    2*S*(Dh + Dv) per head, halved."""
    v_dim = m.v_head_dim or m.head_dim
    return m.num_heads * (m.head_dim + v_dim) * seq_len


def attention_flops_per_token(m: ModelConfig, seq_len: int) -> int:
    """Training FLOPs of QK^T and AV per token, causal counted half."""
    return 3 * m.num_layers * attention_core_flops(m, seq_len)


def flops_per_token(m: ModelConfig, seq_len: int) -> int:
    return 6 * matmul_params_per_token(m) + attention_flops_per_token(m, seq_len)


def layer_forward_flops(m: ModelConfig, layer_id: int, seq_len: int) -> int:
    """Forward FLOPs per token of one decoder layer, the terms of `flops_per_token` (training
    is 3x forward for every term, so forward FLOPs rank pipeline stages as training FLOPs do)."""
    params = attention_params(m) + ffn_params_per_token(m, layer_id)
    return 2 * params + attention_core_flops(m, seq_len)


def head_forward_flops(m: ModelConfig) -> int:
    """Forward FLOPs per token of the output head (often worth several layers)."""
    return 2 * head_params(m)


def peak_flops(device_name: str | None, dtype: str) -> float | None:
    if not device_name or dtype != "bf16":
        return None
    for key, peak in PEAK_BF16_FLOPS:
        if key in device_name:
            return peak
    return None


def tflops_and_mfu(
    m: ModelConfig,
    seq_len: int,
    tokens_per_s: float,
    world: int,
    device_name: str | None,
    dtype: str,
) -> tuple[float, float | None]:
    per_gpu = flops_per_token(m, seq_len) * tokens_per_s / world
    peak = peak_flops(device_name, dtype)
    return per_gpu / 1e12, (per_gpu / peak if peak else None)
