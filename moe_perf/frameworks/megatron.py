"""`trainer=megatron`: Megatron-LM's `pretrain_gpt.py` in the user's Megatron-LM checkout.

The architecture comes from the model preset, flag by flag (Megatron builds its GPT model from
flags alone); the mesh, shapes and steps from the rest of the config; `--mock-data` so that no
corpus is needed, and `--log-interval 1 --log-throughput` for one line per iteration.
`trainer.extra_args` is appended last (argparse keeps the last value of a repeated flag).

Where Megatron's GPT model cannot express a preset's feature (Qwen3.5's Gated DeltaNet, gpt-oss's
sliding window and sinks) it runs what the reference trainer runs (the preset's
`approximations`); DeepSeek-V2-Lite runs its real multi-latent attention, which Megatron has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from moe_perf.common.armcode import ArmCode, visible_gpus
from moe_perf.common.bounds import knob
from moe_perf.common.errors import PrerequisiteError
from moe_perf.common.explain import explain_steps
from moe_perf.frameworks.base import BuildKeys, TrainerLaunch

# Megatron's names for the presets' load-balancing losses (a forced balance makes them moot,
# but an unforced run trains with them)
LOAD_BALANCE = {"global-batch": "global_aux_loss", "sequence": "seq_aux_loss"}

# DeepSeek-V2-Lite's multi-latent attention (public config.json: no q LoRA, kv_lora_rank 512,
# qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128)
MLA = {
    "deepseek-v2-lite": [
        "--multi-latent-attention", "--kv-lora-rank", "512", "--qk-head-dim", "128",
        "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128",
    ],
}  # fmt: skip


def _num(value: Any) -> str:
    """A float as Megatron's parser reads it: 1000000.0 -> 1000000, 0.25 -> 0.25."""
    value = float(value)
    return str(int(value)) if value.is_integer() else repr(value)


def attention_flags(m: Any) -> list[str]:
    if m.name in MLA:
        return ["--num-attention-heads", str(m.num_heads), *MLA[m.name]]
    flags = ["--num-attention-heads", str(m.num_heads), "--kv-channels", str(m.head_dim)]
    if int(m.num_kv_heads) != int(m.num_heads):
        flags += ["--group-query-attention", "--num-query-groups", str(m.num_kv_heads)]
    if m.get("qk_norm"):
        flags.append("--qk-layernorm")
    return flags


def moe_flags(m: Any) -> list[str]:
    layers, dense = int(m.num_layers), min(int(m.get("dense_layers") or 0), int(m.num_layers))
    flags = [
        "--num-experts", str(m.num_experts),
        "--moe-router-topk", str(m.top_k),
        "--moe-ffn-hidden-size", str(m.expert_ffn),
        "--moe-router-score-function", "sigmoid" if m.router == "sigmoid" else "softmax",
        "--moe-router-load-balancing-type", LOAD_BALANCE.get(str(m.load_balance), "aux_loss"),
        "--moe-aux-loss-coeff", _num(m.get("load_balance_coeff") or 0.0),
        "--moe-grouped-gemm",
        "--moe-token-dispatcher-type", "alltoall",
    ]  # fmt: skip
    if not m.get("norm_topk_prob", True):
        # softmax over all experts, then top-k, no renormalisation (DeepSeek-V2)
        flags.append("--moe-router-pre-softmax")
    if int(m.get("num_shared_experts") or 0):
        width = int(m.num_shared_experts) * int(m.shared_expert_ffn)
        flags += ["--moe-shared-expert-intermediate-size", str(width)]
        if m.get("shared_expert_gate"):
            flags.append("--moe-shared-expert-gate")
    if dense:  # the first `dense` layers are dense FFNs, the rest MoE
        flags += ["--moe-layer-freq", f"([0]*{dense}+[1]*{layers - dense})"]
    return flags


def rope_flags(m: Any) -> list[str]:
    flags = ["--position-embedding-type", "rope", "--rotary-base", _num(m.rope_theta)]
    if m.name not in MLA:  # MLA rotates its own qk_pos_emb_head_dim part of each head
        flags += ["--rotary-percent", _num(m.get("rope_fraction") or 1.0)]
    return flags


def model_flags(m: Any, seq_len: int) -> list[str]:
    dense_ffn = int(m.get("dense_ffn") or 0) or int(m.expert_ffn)
    return [
        "--num-layers", str(m.num_layers),
        "--hidden-size", str(m.hidden),
        "--ffn-hidden-size", str(dense_ffn),
        *attention_flags(m),
        *moe_flags(m),
        *rope_flags(m),
        "--normalization", "RMSNorm",
        "--norm-epsilon", _num(m.norm_eps),
        "--swiglu",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        # none of the presets trains with dropout (nor does the reference trainer); Megatron's
        # default is 0.1 on attention probabilities and hidden states
        "--attention-dropout", "0",
        "--hidden-dropout", "0",
        "--max-position-embeddings", str(seq_len),
        # --mock-data with no tokenizer files: the vocabulary size alone sizes the embedding
        "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(m.vocab_size),
    ]  # fmt: skip


def run_flags(cfg: Any) -> list[str]:
    t, mesh = cfg.training, cfg.mesh
    impl = str(cfg.trainer.get("transformer_impl") or "transformer_engine")
    flags = [
        "--tensor-model-parallel-size", "1",
        "--pipeline-model-parallel-size", str(mesh.pp),
        "--context-parallel-size", str(mesh.cp),
        "--expert-model-parallel-size", str(mesh.ep),
        "--seq-length", str(t.sequence_length),
        "--global-batch-size", str(t.global_batch),
        "--micro-batch-size", str(t.micro_batch),
        "--train-iters", str(t.max_steps),
        "--lr", _num(t.lr),
        "--seed", str(t.seed),
        "--mock-data",
        "--log-interval", "1",
        "--log-throughput",
        # no evaluation between or after the timed iterations; nothing saved (no --save). The
        # interval is needed all the same: Megatron-LM sizes its validation split as
        # train_iters // eval_interval + 1 evaluations, and its default is None since the
        # config moved to dataclasses (TypeError: unsupported operand type(s) for //: 'int'
        # and 'NoneType', seen at d98e8a6 on an H200)
        "--eval-iters", "0",
        "--eval-interval", str(t.max_steps),
        "--transformer-impl", impl,
    ]  # fmt: skip
    if impl == "local":
        # local layers norm RMSNorm with torch (WrappedTorchNorm, Apex or not), which refuses
        # Megatron's default persist_layer_norm=True ("persist_layer_norm not supported by
        # torch LayerNorm")
        flags.append("--no-persist-layer-norm")
    flags += routing_flags(cfg)
    if cfg.dtype.name != "fp32":
        flags.append("--bf16")
    if cfg.dtype.fp8:
        flags += ["--fp8-format", "hybrid"]
    return flags


def routing_flags(cfg: Any) -> list[str]:
    """routing=balanced: Megatron's own forced balance, router logits replaced by fresh noise
    (balanced on average, not exactly: docs/routing.md); real: its router as it is. skew has no
    Megatron flag: its force-balance flag takes no target, and its biased router (a per-expert
    logit bias drawn with a std) states no imbalance, so neither gives a planned count."""
    mode = str(cfg.routing.mode)
    if mode == "skew":
        raise PrerequisiteError(
            "trainer=megatron: routing=skew needs a planned per-expert assignment, which "
            "Megatron-LM's router has no option for (--moe-router-force-load-balancing draws "
            "random logits; a biased router takes a logit std, not an imbalance); use "
            "routing=balanced or routing=real with Megatron, or trainer=reference / "
            "trainer=torchtitan for routing=skew"
        )
    return ["--moe-router-force-load-balancing"] if mode == "balanced" else []


def profiling_flags(cfg: Any, arm_dir: Path) -> list[str]:
    """`explain=true`: Megatron's PyTorch profiler (`--profile --use-pytorch-profiler`) on
    every rank over the last measured iterations (it profiles inside its loop, from
    `--profile-step-start` to `--profile-step-end`). Its TensorBoard handler writes
    `<tensorboard dir>/<host>_<pid>.<time>.pt.trace.json`."""
    steps, n = int(cfg.training.max_steps), explain_steps(cfg)
    active = min(n, steps - 1)
    if active < 1:
        return []
    world = int(cfg.mesh.nnodes) * int(cfg.mesh.nproc_per_node)
    return [
        "--profile", "--use-pytorch-profiler",
        "--profile-step-start", str(steps - active),
        "--profile-step-end", str(steps),
        "--profile-ranks", *(str(r) for r in range(world)),
        "--tensorboard-dir", str(arm_dir / "explain"),
    ]  # fmt: skip


def megatron_argv(cfg: Any, arm_dir: Path | None = None) -> list[str]:
    script = str(cfg.trainer.get("script") or "pretrain_gpt.py")
    argv = [script, *model_flags(cfg.model, int(cfg.training.sequence_length)), *run_flags(cfg)]
    argv += profiling_flags(cfg, arm_dir) if arm_dir is not None else []
    return argv + [str(arg) for arg in cfg.trainer.get("extra_args") or []]


@dataclass
class MegatronTrainerSchema(BuildKeys):
    name: str = "megatron"
    code_path: Optional[str] = "megatron"  # noqa: UP045
    script: str = "pretrain_gpt.py"
    transformer_impl: str = knob("transformer_engine", choices=("transformer_engine", "local"))
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, Any] = field(default_factory=dict)


class Megatron:
    schema = MegatronTrainerSchema
    name = schema.name

    def check(self, cfg: Any, repo: Path) -> None:
        routing_flags(cfg)  # routing=skew is refused here, before launch
        code = ArmCode.at_ref(repo, str(cfg.arm.ref)) if cfg.arm.get("ref") else ArmCode(repo)
        script = str(cfg.trainer.get("script") or "pretrain_gpt.py")
        if not code.has(script) or not code.has("megatron/training/arguments.py"):
            raise PrerequisiteError(
                f"trainer=megatron: no {script} with megatron/training beside it at "
                f"{code.where()}; run from a Megatron-LM checkout (the megatron-core wheel has "
                f"no pretrain_gpt.py) or set repo=<its path> / trainer.script=<script>"
            )
        if cfg.dtype.fp8 and str(cfg.trainer.get("transformer_impl")) == "local":
            raise PrerequisiteError(
                "dtype=fp8 needs trainer.transformer_impl=transformer_engine (Megatron's fp8 is "
                "Transformer Engine's)"
            )

    def check_host(self, cfg: Any) -> None:
        want, have = int(cfg.mesh.nproc_per_node), visible_gpus()
        if have < want:
            raise PrerequisiteError(
                f"trainer=megatron needs mesh.nproc_per_node={want} CUDA devices on this host; "
                f"nvidia-smi lists {have}: run on a GPU machine or pick a smaller mesh"
            )

    def launch(self, cfg: Any, arm_dir: Path, config_path: Path, worktree: Path) -> TrainerLaunch:
        env = {str(k): str(v) for k, v in (cfg.trainer.get("env") or {}).items()}
        # Megatron asks for this when its tensor or sequence parallelism overlaps communication
        env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        return TrainerLaunch(argv=megatron_argv(cfg, arm_dir), env=env, log_format="megatron")
