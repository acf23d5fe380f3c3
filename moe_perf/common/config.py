"""The config dataclasses: one set of fields, types, defaults and ranges, read by both worlds.

* The trainer reads `<arm_dir>/config.yaml` (the runner's resolved config) into them with
  `load_config` (yaml.safe_load, no Hydra). Sections and keys it does not use (refs, arm, wandb,
  tag, trainer.command, ...) are ignored, so the runner can grow its config freely; a missing
  required model field is an error naming the field.
* The runner registers the same classes as its Hydra schema (moe_perf/runner/schema.py, which
  adds only what the runner alone reads), so a value of the wrong type fails when the config is
  composed, with Hydra's message, and an unknown key is refused before launch.

Written for both readers: only field types OmegaConf's structured configs accept (int, float,
bool, str, Optional[...] (not `X | None`, which OmegaConf does not read on every Python we
support), list[...] with a default_factory, nested dataclasses; no Union of two types). A
numeric knob carries its range (and a string its choices) in the field's metadata
(common/bounds.py): `check_values` reads them, for the runner before launch and for the
trainer at start-up, with one message per value that names the override.
Overrides are `section.key=value` strings (value parsed as YAML), for tests and bench/.
"""

from __future__ import annotations

import dataclasses
import glob
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from moe_perf.common import routing as routing_plan
from moe_perf.common.bounds import check_values, knob
from moe_perf.common.mesh import MeshDims

# Activation checkpointing: off, or every transformer block recomputed in backward.
AC_MODES = ("none", "full")


class ConfigError(ValueError):
    """A config value the trainer cannot run with; the message names the key."""


@dataclass
class ModelConfig:
    """A model preset (conf/model/*.yaml). Fields without a default must be set by the preset."""

    name: str = knob()
    vocab_size: int = knob(min=1)
    hidden: int = knob(min=1)
    num_layers: int = knob(min=1)
    num_heads: int = knob(min=1)
    num_kv_heads: int = knob(min=1)
    head_dim: int = knob(min=1)
    num_experts: int = knob(min=1)
    top_k: int = knob(min=1)
    expert_ffn: int = knob(min=1)
    tokenizer: str = "synthetic"
    load_balance: str = knob("global-batch", choices=("global-batch", "sequence"))
    load_balance_coeff: float = knob(0.0, min=0)
    v_head_dim: Optional[int] = knob(None, min=1)  # noqa: UP045  (None: head_dim)
    qk_norm: bool = False
    rope_theta: float = knob(10000.0, above=0)
    rope_fraction: float = knob(1.0, above=0, max=1)
    norm_eps: float = knob(1e-6, above=0)
    num_shared_experts: int = knob(0, min=0)
    shared_expert_ffn: int = knob(0, min=0)
    shared_expert_gate: bool = False  # sigmoid gate on the shared expert (Qwen3.5)
    router: str = knob("softmax", choices=("softmax", "sigmoid"))
    norm_topk_prob: bool = True
    router_bias: bool = False
    dense_layers: int = knob(0, min=0)
    dense_ffn: int = knob(0, min=0)
    sliding_window: int = knob(0, min=0)  # not implemented: listed in approximations
    attention_sinks: bool = False  # not implemented: listed in approximations
    swiglu_clamp: float = knob(0.0, min=0)
    approximations: list[str] = field(default_factory=list)


@dataclass
class MeshConfig:
    """Processes and their layout (conf/mesh/*.yaml); dp = world / (pp*cp) is inferred."""

    nnodes: int = knob(1, min=1)
    nproc_per_node: int = knob(1, min=1)
    pp: int = knob(1, min=1)
    cp: int = knob(1, min=1)
    ep: int = knob(1, min=1)
    # GiB of one device where the arms run, for the memory pre-flight; None: this host's (the
    # first GPU's memory, or the machine's RAM on a CPU run). Set it when launching elsewhere.
    device_memory_gib: Optional[float] = knob(None, above=0)  # noqa: UP045

    def dims(self) -> MeshDims:
        return MeshDims(world=self.nnodes * self.nproc_per_node, pp=self.pp, cp=self.cp, ep=self.ep)


@dataclass
class DtypeConfig:
    name: str = knob("bf16", choices=("fp32", "bf16", "fp8"))  # fp8 = bf16 + float8 linears
    fp8: bool = False

    @property
    def float8(self) -> bool:
        """Float8 linears (torchao): dtype=fp8, or fp8=true over another dtype."""
        return self.fp8 or self.name == "fp8"

    @property
    def bf16_compute(self) -> bool:
        """Matmuls and activations in bf16: dtype=bf16, and fp8 (bf16 around its float8
        linears); fp32 computes in fp32."""
        return self.name != "fp32"


@dataclass
class TrainingConfig:
    sequence_length: int = knob(2048, min=1)
    # identical across arms and meshes; divisible by every preset's dp with >= 2*pp per dp rank
    global_batch: int = knob(32, min=1)
    micro_batch: int = knob(1, min=1)
    max_steps: int = knob(8, min=2, why="step 1 is dropped as warm-up")
    seed: int = knob(1234, min=0)
    lr: float = knob(3e-4, above=0)
    device: str = knob("auto", choices=("auto", "cpu", "cuda"))  # auto: cuda if available


def gpu_expected(device: str) -> bool:
    """Whether training.device `device` will train on a GPU here, asked without importing torch:
    cuda, or auto on a machine with an NVIDIA device node."""
    return device == "cuda" or (device == "auto" and bool(glob.glob("/dev/nvidia[0-9]*")))


@dataclass
class RoutingConfig:
    """Which experts the tokens are sent to (conf/routing/*.yaml; docs/routing.md).

    balanced: the router runs, then every token's experts are replaced by a round-robin over
    the global slot index (exact balance); skew: replaced by a fixed plan with the busiest
    expert at `imbalance` x the mean (common/routing.py); real: the router's own top-k.
    The other keys are skew's; under balanced and real they keep their defaults.
    """

    mode: str = knob("balanced", choices=routing_plan.MODES)
    imbalance: float = knob(2.0, min=1)  # the busiest expert's tokens over the mean
    shape: str = knob("hot", choices=routing_plan.SHAPES)
    hot_experts: int = knob(1, min=1)  # shape=hot: how many experts are hot
    hot_ranks: int = knob(1, min=1)  # EP ranks the busiest experts fill (1: one straggler)

    @property
    def forced(self) -> bool:
        """Whether the router's choice is replaced (balanced, skew): the trainer then numbers
        tokens by their global index (MeshDims.token_offset)."""
        return self.mode != "real"


SKEW_KEYS = ("imbalance", "shape", "hot_experts", "hot_ranks")


def routing_problems(routing: Any, model: Any, dims: MeshDims, training: Any) -> list[str]:
    """What the routing request cannot do with this model, mesh and batch (runner and trainer
    alike): a skew knob set under another mode, or a skew no plan meets (common/routing.py).
    Attribute access only: a RoutingConfig or a composed config node."""
    mode = str(routing.mode)
    if mode != "skew":
        changed = [k for k in SKEW_KEYS if getattr(routing, k) != _default(RoutingConfig, k)]
        return [
            f"routing.{k}={getattr(routing, k)} is used only by routing=skew (this run is "
            f"routing={mode}); add routing=skew or remove routing.{k}"
            for k in changed
        ]
    try:
        skew_plan_of(routing, model, dims, training)
    except routing_plan.RoutingError as err:
        return [str(err)]
    return []


def skew_plan_of(routing: Any, model: Any, dims: MeshDims, training: Any):
    """The skew plan of one rank's micro-batch (micro_batch * sequence_length / cp tokens)."""
    return routing_plan.skew_plan(
        num_experts=int(model.num_experts),
        top_k=int(model.top_k),
        tokens=dims.tokens_per_microbatch(int(training.micro_batch),
                                          int(training.sequence_length)),
        ep=dims.ep,
        imbalance=float(routing.imbalance),
        shape=str(routing.shape),
        hot_experts=int(routing.hot_experts),
        hot_ranks=int(routing.hot_ranks),
    )  # fmt: skip


def _default(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


@dataclass
class DataConfig:
    corpus: Optional[str] = None  # noqa: UP045  (None: seeded synthetic tokens)
    root: str = "workspace/datasets"


@dataclass
class TrainerConfig:
    """Knobs of the reference trainer (conf/trainer/reference.yaml)."""

    name: str = "reference"
    compile: bool = False
    # none | full (false/true are read as none/full)
    activation_checkpointing: str = knob("none", choices=AC_MODES)
    pp_schedule: str = "1F1B"
    pp_virtual_stages: int = knob(1, min=1)
    expert_backend: str = knob("auto", choices=("auto", "grouped_mm", "loop"))
    # forced balance on one EP rank: structured = the known round-robin layout (strided
    # copies), sort = the general sort-and-gather dispatch (for A/B of the two)
    forced_dispatch: str = knob("structured", choices=("structured", "sort"))
    weight_decay: float = knob(0.1, min=0)
    max_grad_norm: float = knob(1.0, min=0)  # 0 disables clipping (a global norm reduce)
    init_std: float = knob(0.02, above=0)
    # torch.profiler over the last `profile_steps` steps (0 = off): a kernel table and a Chrome
    # trace per rank in `profile_dir` (default: a `profile` folder beside the config file)
    profile_steps: int = knob(0, min=0)
    profile_dir: Optional[str] = None  # noqa: UP045
    # every thread's Python stack sampled every `sample_stacks_ms` from start-up to the end
    # (0 = off): collapsed stacks per rank, stacks_rank<r>.txt, in profile_dir (stacks.py)
    sample_stacks_ms: float = knob(0.0, min=0)
    # steps run under torch.profiler after the measured ones (0 = off), not counted in the
    # step lines: <arm_dir>/explain/ (set by the runner when explain=true)
    explain_steps: int = knob(0, min=0)
    # one attention forward and backward at the step's shapes in a thread while the model is
    # built, so cuDNN's first use leaves step 1 (runtime.warm_attention_in_background): step 1
    # 2.60 -> 1.63 s, a warm arm 10.59 -> 10.22 s on an H100, losses unchanged
    warm_attention: bool = True
    # dtype=fp8 on one data x context rank: bf16 compute weights over fp32 masters, as bf16
    # has (Config.master_weights), instead of autocast over fp32 weights: fp8 121,200 ->
    # 133,600 tokens/s on an H100 (bf16: 132,500), 2 GiB more peak memory
    fp8_master_weights: bool = True
    # the CUDA context made in a thread while the trainer imports (trainer/early.py), instead
    # of after: a warm arm 11.75 -> 11.28 s on an H100, and 8.27 -> 8.00 s forked from a
    # preloaded interpreter, losses unchanged
    early_cuda_context: bool = True
    # the objects of the trainer's imports moved out of the garbage collector's reach at its
    # `main` (gc.freeze), so step 1's collections no longer walk torch's modules: a warm arm
    # 12.94 -> 12.27 s, step 1 2.34 -> 1.97 s on an H100, losses unchanged
    gc_freeze: bool = True

    def __post_init__(self):
        self.activation_checkpointing = ac_mode(self.activation_checkpointing)


def ac_mode(value: Any) -> str:
    """trainer.activation_checkpointing as one of AC_MODES (YAML's false/true read as none/full;
    a str field given a bool by OmegaConf holds "False"/"True")."""
    mode = {"false": "none", "true": "full"}.get(str(value).lower(), str(value).lower())
    if value is None:
        mode = "none"
    if mode not in AC_MODES:
        raise ConfigError(f"trainer.activation_checkpointing={value!r}: expected none or full")
    return mode


@dataclass
class Config:
    """What the trainer reads: the sections of the resolved config that describe the run."""

    model: ModelConfig
    mesh: MeshConfig = field(default_factory=MeshConfig)
    dtype: DtypeConfig = field(default_factory=DtypeConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)

    @property
    def mesh_dims(self) -> MeshDims:
        return self.mesh.dims()

    @property
    def master_weights(self) -> bool:
        """Whether the compute weights are bf16 copies over fp32 masters (trainer/precision.py):
        on one data x context rank (on several FSDP's mixed precision does the same), under
        dtype=bf16, and under dtype=fp8 with trainer.fp8_master_weights (torchao's float8
        linears then cast bf16 weights; without it autocast casts fp32 ones in every
        micro-batch). The one rule of parallelize and the memory estimate."""
        if self.mesh_dims.dp_cp > 1:
            return False
        if self.dtype.float8:
            return self.trainer.fp8_master_weights
        return self.dtype.name == "bf16"

    def validate(self) -> MeshDims:
        """Every value in its range, the runner's mesh checks (same messages), plus what only
        the trainer knows."""
        problems = check_values(Config, self, "")
        if problems:
            raise ConfigError("; ".join(problems))
        dims = self.mesh_dims
        t = self.training
        dims.validate(
            sequence_length=t.sequence_length,
            global_batch=t.global_batch,
            micro_batch=t.micro_batch,
            num_experts=self.model.num_experts,
        )
        for problem in model_problems(self.model):
            raise ConfigError(problem)
        for problem in routing_problems(self.routing, self.model, dims, t):
            raise ConfigError(problem)
        return dims


def model_problems(m: Any) -> list[str]:
    """What a model preset must satisfy beyond each field's own range (a mapping or a
    ModelConfig): shared by the runner's pre-flight and the trainer's start-up."""
    get = m.get if isinstance(m, Mapping) else lambda k, d=None: getattr(m, k, d)
    heads, kv_heads = get("num_heads"), get("num_kv_heads")
    experts, top_k = get("num_experts"), get("top_k")
    layers, dense = get("num_layers"), get("dense_layers", 0)
    problems = []
    if heads % kv_heads:
        problems.append(
            f"model.num_heads={heads} is not a multiple of model.num_kv_heads={kv_heads}; "
            f"change model.num_kv_heads"
        )
    if not 0 < top_k <= experts:
        problems.append(f"model.top_k={top_k} must be in 1..model.num_experts={experts}")
    if dense > layers:
        problems.append(f"model.dense_layers={dense} > model.num_layers={layers}")
    if dense and not get("dense_ffn", 0):
        problems.append("model.dense_layers > 0 needs model.dense_ffn")
    return problems


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
    if "benchmark" in (raw.get("training") or {}):
        # an old config's forced-balance switch: ignoring it would silently run balanced
        raise ConfigError(
            "training.benchmark was replaced by the routing group: routing.mode=balanced (was "
            "true) or routing.mode=real (was false)"
        )
    return Config(
        model=_build(ModelConfig, raw["model"], "model"),
        mesh=_build(MeshConfig, raw.get("mesh"), "mesh"),
        dtype=_build(DtypeConfig, raw.get("dtype"), "dtype"),
        training=_build(TrainingConfig, raw.get("training"), "training"),
        data=_build(DataConfig, raw.get("data"), "data"),
        trainer=_build(TrainerConfig, raw.get("trainer"), "trainer"),
        routing=_build(RoutingConfig, raw.get("routing"), "routing"),
    )


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    raw = yaml.safe_load(path.read_text()) or {}
    return config_from_dict(apply_overrides(raw, list(overrides)))
