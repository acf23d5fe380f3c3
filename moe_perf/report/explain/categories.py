"""The categories of explain's breakdown, and the rules that put an op or a kernel in one.

Expert GEMMs are told from dense ones by the name (grouped GEMM, the reference trainer's
`moe_perf::expert_bmm` ops) or by the trainer's profiler scope `moe_perf.experts` around the
experts' forward (traces.py matches backward ops to it).
"""

from __future__ import annotations

import re

EXPERT_SCOPE = "moe_perf.experts"

CATEGORIES = (  # key, label; the order of the tables
    ("dense_gemm", "dense GEMM"),
    ("expert_gemm", "expert/grouped GEMM"),
    ("attention", "attention"),
    ("all_to_all", "all-to-all"),
    ("collectives", "other collectives"),
    ("optimizer", "optimizer"),
    ("norms_elementwise", "norms/elementwise"),
    ("routing", "routing (sort/scatter/gather)"),
    ("copies", "memory copies"),
    ("host_idle", "host gaps/idle"),
    ("other", "other"),
)
LABELS = dict(CATEGORIES)

# A name anywhere in an op's chain (the op and the ops around it) that decides the category
# whatever the op itself is: the copies inside `Optimizer.step` are optimizer time.
_SCOPES = (
    ("all_to_all", re.compile(r"all_?to_?all")),
    (
        "collectives",
        re.compile(
            r"nccl|gloo:|c10d::|c10d_functional|all_?reduce|all_?gather|reduce_?scatter|broadcast"
            r"|barrier|sendrecv"
        ),
    ),  # fmt: skip
    ("optimizer", re.compile(r"^optimizer\.|_foreach_|adamw|_fused_adam|multi_tensor_apply")),
)
SCOPE_KEYS = {key for key, _ in _SCOPES}
# Otherwise the innermost name of the chain that matches, in this order, decides (an
# `aten::t` inside `aten::linear` is GEMM time; a copy kernel is a copy before an elementwise).
_NAMES = (
    ("attention", re.compile(r"scaled_dot_product|flash|fmha|attention|sdpa")),
    (
        "gemm",
        re.compile(
            r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_grouped_mm|mv)$|mmbackward|gemm|cutlass"
            r"|cublas|nvjet|xmma|wgmma|grouped_mm|expert_bmm"
        ),
    ),  # fmt: skip
    ("routing", re.compile(r"sort|topk|scatter|gather|index|cumsum|bincount|histc|unique")),
    (
        "copies",
        re.compile(
            r"memcpy|memset|copy|^aten::(to|clone|contiguous|cat|stack|zero_|zeros|fill_|empty"
            r"|empty_strided|empty_like|new_zeros|new_empty|full|full_like|ones_like|zeros_like)$"
            r"|catarray"
        ),
    ),  # fmt: skip
    (
        "norms_elementwise",
        re.compile(
            r"norm|elementwise|vectorized|reduce|softmax|silu|gelu|sigmoid|tanh|(?<![a-z])exp(?![a-z])|log|mul|add"
            r"|sub|div|pow|sqrt|neg|abs|sum|mean|max|min|where|clamp|cos|sin|rope|triton|nll_loss"
            r"|cross_entropy|relu|dropout|reciprocal|masked|unrolled|accumulategrad|type_as|lerp"
            r"|square|fused"
        ),
    ),  # fmt: skip
)
_GROUPED = re.compile(r"grouped|expert")  # the reference trainer's moe_perf::expert_bmm too


def categorize(chain: list[str], in_experts: bool = False) -> str:
    """The category key of an op or kernel; `chain` = its name, then its enclosing ops'."""
    low = [name.lower() for name in chain]
    for key, pattern in _SCOPES:
        if any(pattern.search(name) for name in low):
            return key
    for name in low:
        for key, pattern in _NAMES:
            if pattern.search(name):
                if key != "gemm":
                    return key
                grouped = any(_GROUPED.search(n) for n in low)
                return "expert_gemm" if in_experts or grouped else "dense_gemm"
    return "other"
