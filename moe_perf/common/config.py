"""The resolved config file the runner writes, read into plain dataclasses (no Hydra here).

`load_config(path, overrides)` reads `<arm_dir>/config.yaml` with yaml.safe_load. Sections and
keys the trainer does not use (refs, arm, wandb, tag, ...) are ignored, so the runner can grow
its config freely; a missing required model field is an error naming the field.
Overrides are `section.key=value` strings (value parsed as YAML), for tests and bench/.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from moe_perf.common.mesh import MeshDims


class ConfigError(ValueError):
    """A config value the trainer cannot run with; the message names the key."""


@dataclass
class ModelConfig:
    name: str
    vocab_size: int
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_ffn: int
    tokenizer: str = "synthetic"
    load_balance: str = "global-batch"
    load_balance_coeff: float = 0.0
    v_head_dim: int | None = None
    qk_norm: bool = False
    rope_theta: float = 10000.0
    rope_fraction: float = 1.0
    norm_eps: float = 1e-6
    num_shared_experts: int = 0
    shared_expert_ffn: int = 0
    shared_expert_gate: bool = False  # sigmoid gate on the shared expert (Qwen3.5)
    router: str = "softmax"
    norm_topk_prob: bool = True
    router_bias: bool = False
    dense_layers: int = 0
    dense_ffn: int = 0
    sliding_window: int = 0  # not implemented: listed in approximations
    attention_sinks: bool = False  # not implemented: listed in approximations
    swiglu_clamp: float = 0.0
    approximations: list = field(default_factory=list)


@dataclass
class MeshConfig:
    nnodes: int = 1
    nproc_per_node: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def dims(self) -> MeshDims:
        return MeshDims(world=self.nnodes * self.nproc_per_node, pp=self.pp, cp=self.cp, ep=self.ep)


@dataclass
class DtypeConfig:
    name: str = "bf16"  # fp32 | bf16 | fp8 (fp8 = bf16 with float8 linear layers)
    fp8: bool = False


@dataclass
class TrainingConfig:
    sequence_length: int = 2048
    global_batch: int = 8
    micro_batch: int = 1
    max_steps: int = 8
    benchmark: bool = True  # forced-balance routing
    seed: int = 0
    lr: float = 3e-4
    device: str = "auto"  # auto | cpu | cuda


@dataclass
class DataConfig:
    corpus: str | None = None  # None: seeded synthetic tokens
    root: str = "workspace/datasets"


@dataclass
class TrainerConfig:
    """Knobs of the reference trainer (conf/trainer/reference.yaml)."""

    name: str = "reference"
    compile: bool = False
    activation_checkpointing: str | bool = False  # none/false -> False; full/true -> "full"
    pp_schedule: str = "1F1B"
    pp_virtual_stages: int = 1
    expert_backend: str = "auto"  # auto (grouped_mm where it runs) | grouped_mm | loop
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0  # 0 disables clipping (clipping costs a global norm reduce)
    init_std: float = 0.02
    # torch.profiler over the last `profile_steps` steps (0 = off): a kernel table and a Chrome
    # trace per rank in `profile_dir` (default: a `profile` folder beside the config file)
    profile_steps: int = 0
    profile_dir: str | None = None

    def __post_init__(self):
        ac = self.activation_checkpointing
        if ac in (None, False, "none", "false"):
            self.activation_checkpointing = False
        elif ac in (True, "full", "true"):
            self.activation_checkpointing = "full"
        else:
            raise ConfigError(f"trainer.activation_checkpointing={ac!r}: expected none or full")


@dataclass
class Config:
    model: ModelConfig
    mesh: MeshConfig = field(default_factory=MeshConfig)
    dtype: DtypeConfig = field(default_factory=DtypeConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @property
    def mesh_dims(self) -> MeshDims:
        return self.mesh.dims()

    def validate(self) -> MeshDims:
        """The runner's mesh checks (same messages), plus what only the trainer knows."""
        dims = self.mesh_dims
        t = self.training
        dims.validate(
            sequence_length=t.sequence_length,
            global_batch=t.global_batch,
            micro_batch=t.micro_batch,
            num_experts=self.model.num_experts,
        )
        m = self.model
        if m.num_heads % m.num_kv_heads:
            raise ConfigError(
                f"model.num_heads={m.num_heads} is not a multiple of "
                f"model.num_kv_heads={m.num_kv_heads}"
            )
        if not 0 < m.top_k <= m.num_experts:
            raise ConfigError(f"model.top_k={m.top_k} must be in 1..model.num_experts")
        if m.dense_layers > m.num_layers:
            raise ConfigError(f"model.dense_layers={m.dense_layers} > num_layers={m.num_layers}")
        if m.dense_layers and not m.dense_ffn:
            raise ConfigError("model.dense_layers > 0 needs model.dense_ffn")
        if self.dtype.name not in ("fp32", "bf16", "fp8"):
            raise ConfigError(f"dtype.name={self.dtype.name!r}: expected fp32, bf16 or fp8")
        if self.trainer.expert_backend not in ("auto", "grouped_mm", "loop"):
            raise ConfigError(
                f"trainer.expert_backend={self.trainer.expert_backend!r}: "
                "expected auto, grouped_mm or loop"
            )
        return dims


def _build(cls, data: dict | None, section: str):
    data = dict(data or {})
    names = {f.name for f in dataclasses.fields(cls)}
    known = {k: v for k, v in data.items() if k in names}
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in known
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"config is missing {', '.join(f'{section}.{k}' for k in missing)}")
    return cls(**known)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"override {item!r}: expected section.key=value")
        node = raw
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    return raw


def config_from_dict(raw: dict) -> Config:
    if "model" not in raw:
        raise ConfigError("config has no model section")
    return Config(
        model=_build(ModelConfig, raw["model"], "model"),
        mesh=_build(MeshConfig, raw.get("mesh"), "mesh"),
        dtype=_build(DtypeConfig, raw.get("dtype"), "dtype"),
        training=_build(TrainingConfig, raw.get("training"), "training"),
        data=_build(DataConfig, raw.get("data"), "data"),
        trainer=_build(TrainerConfig, raw.get("trainer"), "trainer"),
    )


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    raw = yaml.safe_load(path.read_text()) or {}
    return config_from_dict(apply_overrides(raw, list(overrides)))
