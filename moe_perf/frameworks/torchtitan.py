"""`trainer=torchtitan`: the user's torchtitan checkout, each arm from its own worktree.

The arm's torchtitan is the one in its worktree (the runner puts the worktree first on
PYTHONPATH), and so is the CLI it speaks, read from its files:

* 0.2.x (`torchtitan/config/job_config.py`): a JobConfig with an optional TOML
  (`--job.config_file`), the model by `--model.name` and `--model.flavor`;
* 0.3.x (`torchtitan/trainer.py`, no job_config.py): a Python config registry,
  `--module <model> --config <function of its config_registry>`.

torchtitan has no flag for the depth, (0.3.x) for float8 or for a skewed routing: a cut depth,
fp8 under 0.3.x or routing=skew runs `python -m moe_perf.titan_entry`, which registers a
derived flavor (config) and the skew plan in-process and then calls torchtitan's own main.
Everything else is torchtitan's flags, mapped from the composed config; `trainer.extra_args` is
appended last, so it can override any of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from moe_perf.common.armcode import ArmCode, check_fp8_host, visible_gpus
from moe_perf.common.bounds import knob
from moe_perf.common.errors import PrerequisiteError
from moe_perf.common.explain import explain_steps
from moe_perf.frameworks.base import BuildKeys, TrainerLaunch
from moe_perf.titan_entry import FORCED_ROUTING, ROUTER_MODULES

TOML_CLI = "0.2"  # JobConfig + TOML, --model.name/--model.flavor
REGISTRY_CLI = "0.3"  # --module/--config


@dataclass(frozen=True)
class TitanModel:
    name: str  # the model package: torchtitan/models/<name> (0.2 --model.name, 0.3 --module)
    flavor: str  # 0.2 --model.flavor: a key of the model's flavor table
    config: str  # 0.3 --config: a function of torchtitan/models/<name>/config_registry.py
    num_layers: int  # the flavor's depth; another model.num_layers runs a cut copy


# Our model presets and the torchtitan flavors of the same architecture (deepseek_v3's 16B is
# DeepSeek-V2-Lite's shape: 27 layers, the first dense, 64 experts top-6, 2 shared).
MODELS = {
    "qwen3-30b-a3b": TitanModel("qwen3", "30B-A3B", "qwen3_30b_a3b", 48),
    "qwen3.5-35b-a3b": TitanModel("qwen3_5", "35B-A3B", "qwen35_35b_a3b", 40),
    "deepseek-v2-lite": TitanModel("deepseek_v3", "16B", "deepseek_v3_16b", 27),
    "gpt-oss-20b": TitanModel("gpt_oss", "20b", "gpt_oss_20b", 24),
    "gpt-oss-120b": TitanModel("gpt_oss", "120b", "gpt_oss_120b", 36),
}

# Never a hub download: torchtitan reads these from the worktree, and the hub libraries are
# told to stay offline, so a missing local file fails instead of fetching.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

# torchtitan's own local datasets: name -> the path its loader reads when no dataset_path is set
LOCAL_DATASETS = {"c4_test": "tests/assets/c4_test"}


def titan_cli(code: ArmCode) -> str:
    """Which CLI the arm's torchtitan speaks, from its files."""
    if code.has("torchtitan/config/job_config.py"):
        return TOML_CLI
    if code.has("torchtitan/trainer.py") and code.has("torchtitan/config/manager.py"):
        return REGISTRY_CLI
    raise PrerequisiteError(
        f"trainer=torchtitan: no torchtitan in {code.where()} (neither "
        f"torchtitan/config/job_config.py, the 0.2 CLI, nor torchtitan/trainer.py with "
        f"torchtitan/config/manager.py, the 0.3 CLI); run from a torchtitan checkout or set "
        f"repo=<its path>"
    )


def titan_model(cfg: Any) -> tuple[TitanModel, bool]:
    """(torchtitan's model, whether the preset's flavor is cut to model.num_layers)."""
    t = cfg.trainer
    preset = MODELS.get(str(cfg.model.name))
    if t.get("model_name"):  # the user's own flavor, taken whole
        name, flavor, config = str(t.model_name), t.get("flavor"), t.get("config")
        if not (flavor or config):
            raise PrerequisiteError(
                f"trainer.model_name={name} needs trainer.flavor (0.2 CLI) or trainer.config "
                f"(0.3 CLI)"
            )
        return TitanModel(name, str(flavor or ""), str(config or ""), 0), False
    if preset is None:
        raise PrerequisiteError(
            f"model={cfg.model.name} has no torchtitan flavor: use one of "
            f"{', '.join(MODELS)}, or name torchtitan's own with trainer.model_name and "
            f"trainer.flavor / trainer.config"
        )
    layers = int(cfg.model.num_layers)
    if not 1 <= layers <= preset.num_layers:
        raise PrerequisiteError(
            f"model.num_layers={layers}: torchtitan's {preset.name} {preset.flavor} has "
            f"{preset.num_layers} layers; a cut depth must be 1..{preset.num_layers}"
        )
    return preset, layers != preset.num_layers


def derived_name(base: str, num_layers: int | None, fp8: bool, cli: str) -> str:
    """The key the entry registers: `30B-A3B-4layers` (0.2), `qwen3_30b_a3b_4layers_fp8`."""
    sep = "-" if cli == TOML_CLI else "_"
    parts = [base] + ([f"{num_layers}layers"] if num_layers else []) + (["fp8"] if fp8 else [])
    return sep.join(parts)


def parallelism_flags(cfg: Any) -> list[str]:
    m = cfg.mesh
    flags = [
        "--parallelism.pipeline_parallel_degree", str(m.pp),
        "--parallelism.context_parallel_degree", str(m.cp),
        "--parallelism.expert_parallel_degree", str(m.ep),
        "--parallelism.tensor_parallel_degree", "1",
        # -1: torchtitan infers world / (pp * cp * tp), the dp our mesh infers
        "--parallelism.data_parallel_shard_degree", "-1",
        "--parallelism.data_parallel_replicate_degree", "1",
    ]  # fmt: skip
    if int(m.pp) > 1:
        flags += [
            "--parallelism.pipeline_parallel_microbatch_size",
            str(cfg.training.micro_batch),
        ]
    return flags


def local_batch_size(cfg: Any, dp: int) -> int:
    """torchtitan's sequences per rank and forward/backward pass.

    Without pipeline parallelism that is our micro-batch: torchtitan accumulates gradients over
    global_batch / (local_batch_size * dp) passes, as the reference trainer does over its
    micro-batches. Under pp the local batch is the rank's whole share of the step, which the
    schedule splits into `pipeline_parallel_microbatch_size` pieces.
    """
    if int(cfg.mesh.pp) > 1:
        return int(cfg.training.global_batch) // dp
    return int(cfg.training.micro_batch)


def training_flags(cfg: Any) -> list[str]:
    t = cfg.training
    m = cfg.mesh
    dp = int(m.nnodes) * int(m.nproc_per_node) // (int(m.pp) * int(m.cp))
    flags = [
        "--training.seq_len", str(t.sequence_length),
        "--training.global_batch_size", str(t.global_batch),
        "--training.local_batch_size", str(local_batch_size(cfg, dp)),
        "--training.steps", str(t.max_steps),
        "--training.mixed_precision_param", "float32" if cfg.dtype.name == "fp32" else "bfloat16",
        "--debug.seed", str(t.seed),
        # forced routing (balanced: torchtitan's round-robin; skew: the entry's plan in its
        # place) replaces the expert ids after the real top-k; real: the router's own
        "--debug.moe_force_load_balance" if str(cfg.routing.mode) != "real"
        else "--debug.no_moe_force_load_balance",
        "--metrics.log_freq", "1",
        "--checkpoint.no_enable",
    ]  # fmt: skip
    if cfg.trainer.get("compile"):
        flags.append("--compile.enable")
    return flags


def data_flags(cfg: Any, section: str) -> list[str]:
    tr = cfg.trainer
    flags = [f"--{section}.dataset", str(tr.dataset)]
    if tr.get("dataset_path"):
        flags += [f"--{section}.dataset_path", str(tr.dataset_path)]
    return flags


def toml_cli_argv(cfg: Any, model: TitanModel, flavor: str, arm_dir: Path) -> list[str]:
    tr = cfg.trainer
    argv = ["--job.config_file", str(tr.job_config)] if tr.get("job_config") else []
    argv += [
        "--job.dump_folder", str(arm_dir / "torchtitan"),
        "--model.name", model.name,
        "--model.flavor", flavor,
        "--model.hf_assets_path", str(tr.tokenizer),
        *data_flags(cfg, "training"),
        *training_flags(cfg),
        *parallelism_flags(cfg),
        "--optimizer.lr", str(cfg.training.lr),
        "--activation_checkpoint.mode", str(tr.get("activation_checkpointing") or "none"),
    ]  # fmt: skip
    if cfg.dtype.fp8:
        argv += ["--model.converters", "quantize.linear.float8"]
    return argv


def registry_cli_argv(cfg: Any, model: TitanModel, config: str, arm_dir: Path) -> list[str]:
    tr = cfg.trainer
    argv = [
        "--module", model.name,
        "--config", config,
        "--dump_folder", str(arm_dir / "torchtitan"),
        "--hf_assets_path", str(tr.tokenizer),
        *data_flags(cfg, "dataloader"),
        *training_flags(cfg),
        *parallelism_flags(cfg),
    ]  # fmt: skip
    if int(cfg.mesh.pp) > 1 or int(cfg.mesh.ep) > 1:
        # 0.3 captures CUDA graphs by default and refuses them under PP, and under EP with its
        # default all-to-all dispatcher (it synchronizes with the host)
        argv.append("--training.disable_cuda_graphs")
    return argv


def profiling_flags(cfg: Any, arm_dir: Path) -> list[str]:
    """`explain=true`: torchtitan's own profiler over the last measured steps.

    torchtitan profiles inside its loop on a schedule (wait, warmup, active steps every
    `profile_freq`), so the profiled steps are the last `explain_steps` measured ones (one
    warm-up step before them). It writes `<save_traces_folder>/iteration_<N>/rank<r>_trace.json`;
    an absolute folder is used as it is.
    """
    steps, n = int(cfg.training.max_steps), explain_steps(cfg)
    active = min(n, steps - 1)
    if active < 1:
        return []
    return [
        "--profiling.enable_profiling",
        "--profiling.save_traces_folder", str(arm_dir / "explain"),
        "--profiling.profile_freq", str(steps),
        "--profiling.profiler_active", str(active),
        "--profiling.profiler_warmup", "1",
    ]  # fmt: skip


def check_local_file(code: ArmCode, setting: str, path: str, what: str) -> None:
    """A path torchtitan reads: relative to the worktree (the arm's commit) or absolute."""
    absolute = Path(path).expanduser()
    found = absolute.exists() if absolute.is_absolute() else code.has(path)
    if not found:
        where = str(absolute) if absolute.is_absolute() else f"{path} at {code.where()}"
        raise PrerequisiteError(
            f"{setting}={path}: no {what} there ({where}); torchtitan runs offline here (no hub "
            f"download): set {setting} to a local path, relative to the repository or absolute"
        )


def check_data(cfg: Any, code: ArmCode) -> None:
    tr = cfg.trainer
    tokenizer = str(tr.tokenizer)
    check_local_file(code, "trainer.tokenizer", tokenizer.rstrip("/") + "/tokenizer.json",
                     "tokenizer.json")  # fmt: skip
    dataset_path = tr.get("dataset_path") or LOCAL_DATASETS.get(str(tr.dataset))
    if not dataset_path:
        raise PrerequisiteError(
            f"trainer.dataset={tr.dataset} would be downloaded from the hub: set "
            f"trainer.dataset_path to a local copy, or trainer.dataset=c4_test (torchtitan's "
            f"own test data)"
        )
    check_local_file(code, "trainer.dataset_path", str(dataset_path), "dataset")


def check_model_code(cfg: Any, code: ArmCode, model: TitanModel, cli: str) -> None:
    package = f"torchtitan/models/{model.name}"
    if not code.has(f"{package}/__init__.py"):
        raise PrerequisiteError(
            f"model={cfg.model.name}: the torchtitan at {code.where()} has no {package} "
            f"(torchtitan model {model.name}); pick another model or a torchtitan that has it"
        )
    if cli == TOML_CLI and int(cfg.mesh.pp) > 1:
        # torchtitan 0.2 refuses PP at start-up for models whose TrainSpec has no pipelining
        # function (qwen3, gpt_oss); the same words before launch save a cold start
        source = code.read(f"{package}/__init__.py") or ""
        if "pipelining_fn=None" in source:
            raise PrerequisiteError(
                f"mesh.pp={cfg.mesh.pp}: torchtitan's {model.name} at {code.where()} does not "
                f"support pipelining (its TrainSpec has pipelining_fn=None); pick a mesh "
                f"with pp=1"
            )
    if (
        cli == REGISTRY_CLI
        and cfg.dtype.fp8
        and not code.has("torchtitan/components/quantization/float8.py")
    ):
        raise PrerequisiteError(
            f"dtype=fp8: the torchtitan at {code.where()} has no float8 converter "
            f"(torchtitan/components/quantization/float8.py); use dtype=bf16"
        )


def check_routing(cfg: Any, code: ArmCode) -> None:
    """routing=skew is installed by our entry in place of torchtitan's forced-routing method:
    the arm's torchtitan must have one."""
    if str(cfg.routing.mode) != "skew":
        return
    files = [m.replace(".", "/") + ".py" for m in ROUTER_MODULES]
    if not any(f"def {FORCED_ROUTING}" in (code.read(f) or "") for f in files):
        raise PrerequisiteError(
            f"routing=skew: the torchtitan at {code.where()} has no router method "
            f"{FORCED_ROUTING} (in {', '.join(files)}), which moe_perf replaces by the skew "
            f"plan; use routing=balanced or routing=real, or a torchtitan that has it"
        )


def skew_entry_args(cfg: Any) -> list[str]:
    """The entry's flags for routing=skew (titan_entry.install_skew); [] otherwise."""
    r, t, m = cfg.routing, cfg.training, cfg.model
    if str(r.mode) != "skew":
        return []
    # a router call's tokens: one micro-batch of one rank (torchtitan's local batch, or its
    # pipeline micro-batch), sequences cut by cp, as the reference trainer's plan
    tokens = int(t.micro_batch) * int(t.sequence_length) // int(cfg.mesh.cp)
    return ["--skew", str(float(r.imbalance)), "--skew-shape", str(r.shape),
            "--skew-hot-experts", str(r.hot_experts), "--skew-hot-ranks", str(r.hot_ranks),
            "--skew-ep", str(cfg.mesh.ep), "--skew-tokens", str(tokens),
            "--skew-experts", str(m.num_experts), "--skew-top-k", str(m.top_k)]  # fmt: skip


@dataclass
class TorchtitanTrainerSchema(BuildKeys):
    name: str = "torchtitan"
    code_path: Optional[str] = "torchtitan"  # noqa: UP045
    model_name: Optional[str] = None  # noqa: UP045
    flavor: Optional[str] = None  # noqa: UP045
    config: Optional[str] = None  # noqa: UP045
    job_config: Optional[str] = None  # noqa: UP045
    tokenizer: str = "tests/assets/tokenizer"
    dataset: str = "c4_test"
    dataset_path: Optional[str] = "tests/assets/c4_test"  # noqa: UP045
    compile: bool = False
    activation_checkpointing: str = knob("none", choices=("none", "selective", "full"))
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, Any] = field(default_factory=dict)


class TorchTitan:
    schema = TorchtitanTrainerSchema
    name = schema.name

    def check(self, cfg: Any, repo: Path) -> None:
        model, _ = titan_model(cfg)
        code = ArmCode.at_ref(repo, str(cfg.arm.ref)) if cfg.arm.get("ref") else ArmCode(repo)
        cli = titan_cli(code)
        check_model_code(cfg, code, model, cli)
        check_routing(cfg, code)
        check_data(cfg, code)
        if str(cfg.dtype.name) not in ("bf16", "fp32", "fp8"):
            raise PrerequisiteError(f"dtype.name={cfg.dtype.name}: torchtitan runs bf16, fp32, fp8")

    def check_host(self, cfg: Any) -> None:
        """torchtitan trains on CUDA devices only (it falls back to "cuda" without one)."""
        want, have = int(cfg.mesh.nproc_per_node), visible_gpus()
        if have < want:
            raise PrerequisiteError(
                f"trainer=torchtitan needs mesh.nproc_per_node={want} CUDA devices on this "
                f"host; nvidia-smi lists {have}: run on a GPU machine or pick a smaller mesh"
            )
        check_fp8_host(cfg)  # its float8 converter is torchao's

    def launch(self, cfg: Any, arm_dir: Path, config_path: Path, worktree: Path) -> TrainerLaunch:
        cli = titan_cli(ArmCode(worktree))
        model, cut = titan_model(cfg)
        layers = int(cfg.model.num_layers) if cut else None
        fp8_in_process = bool(cfg.dtype.fp8) and cli == REGISTRY_CLI
        base = model.flavor if cli == TOML_CLI else model.config
        name = derived_name(base, layers, fp8_in_process, cli)
        if cli == TOML_CLI:
            argv = toml_cli_argv(cfg, model, name, arm_dir)
        else:
            argv = registry_cli_argv(cfg, model, name, arm_dir)
        argv += profiling_flags(cfg, arm_dir)
        argv += [str(arg) for arg in cfg.trainer.get("extra_args") or []]
        if cli == REGISTRY_CLI:
            # 0.3's activation checkpointing is a subcommand of its CLI (tyro), last on the line;
            # its model configs default to selective or full, which the config did not ask for
            argv.append(
                f"activation-checkpoint:{cfg.trainer.get('activation_checkpointing') or 'none'}"
            )
        skew = skew_entry_args(cfg)
        if name == base and not skew:
            entry = ["-m", "torchtitan.train"]
        else:  # register the derived flavor (and the skew plan) in-process, then torchtitan's main
            entry = ["-m", "moe_perf.titan_entry", "--cli", cli, "--model", model.name,
                     "--base", base, "--as", name]  # fmt: skip
            entry += ["--num-layers", str(layers)] if layers else []
            entry += ["--float8"] if fp8_in_process else []
            entry += [*skew, "--"]
        env = dict(OFFLINE_ENV)
        env.update({str(k): str(v) for k, v in (cfg.trainer.get("env") or {}).items()})
        return TrainerLaunch(argv=entry + argv, env=env, log_format="torchtitan")
