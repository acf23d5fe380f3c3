"""trainer=megatron: the command line each arm gets, read back by Megatron-LM's own parser.

Megatron-LM's `megatron.training.arguments` parses every generated command (model preset x
mesh preset) and then runs its own `validate_args` on it (world size, pipeline, expert and
context arithmetic, MoE settings). Its CUDA device queries (compute capability for grouped
GEMM, the architecture for context parallelism) are answered as an H200 would (sm90). Where
`megatron.training` does not import (see the skip reason), the architecture of each preset is
still checked flag by flag.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.compose import composed as compose_config

from moe_perf.common.errors import PrerequisiteError
from moe_perf.frameworks.megatron import Megatron, megatron_argv
from moe_perf.runner import compile_cache

ROOT = Path(__file__).resolve().parents[1]
MODELS = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml") if p.stem != "tiny")
MESHES = sorted(p.stem for p in (ROOT / "conf" / "mesh").glob("*.yaml"))


def composed(*overrides: str):
    """The config with trainer=megatron; `overrides` come after, as on a command line."""
    return compose_config("trainer=megatron", *overrides)


def megatron_arguments():
    try:
        import megatron.training.arguments as arguments
    except ImportError as err:
        return None, str(err)
    return arguments, ""


ARGUMENTS, WHY_NOT = megatron_arguments()
needs_megatron = pytest.mark.skipif(
    ARGUMENTS is None,
    reason=f"megatron.training does not import ({WHY_NOT}): PyPI's megatron-core wheels for "
    f"Python 3.11 (<= 0.16.1) hold only megatron/core, and those with megatron/training "
    f"(>= 0.17) need Python >= 3.12; put a Megatron-LM checkout on PYTHONPATH to run this",
)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@needs_megatron
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("model", MODELS)
def test_every_preset_command_is_accepted_and_validated_by_megatron(
    model, mesh, monkeypatch, tmp_path
):
    cfg = composed(f"model={model}", f"mesh={mesh}", "model.num_layers=4")
    launch = Megatron().launch(cfg, tmp_path, tmp_path / "config.yaml", tmp_path)
    argv = launch.argv
    assert argv[0] == "pretrain_gpt.py"
    for key, value in launch.env.items():  # the environment the arm adds
        monkeypatch.setenv(key, value)
    world = cfg.mesh.nnodes * cfg.mesh.nproc_per_node
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(sys, "argv", argv)
    args = ARGUMENTS.parse_args()
    m, t = cfg.model, cfg.training
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (
        4, m.hidden, m.num_heads)  # fmt: skip
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (
        m.num_experts, m.top_k, m.expert_ffn)  # fmt: skip
    assert args.vocab_size == m.vocab_size
    mesh = (args.pipeline_model_parallel_size, args.context_parallel_size)
    assert mesh == (cfg.mesh.pp, cfg.mesh.cp)
    assert args.expert_model_parallel_size == cfg.mesh.ep
    assert (args.seq_length, args.global_batch_size, args.micro_batch_size, args.train_iters) == (
        t.sequence_length, t.global_batch, t.micro_batch, t.max_steps)  # fmt: skip
    assert args.moe_router_force_load_balancing and args.mock_data and args.log_throughput
    assert args.log_interval == 1 and args.bf16
    assert args.attention_dropout == 0.0 and args.hidden_dropout == 0.0
    # no evaluation, but an interval: Megatron sizes its validation split with it
    assert args.eval_iters == 0 and args.train_iters // args.eval_interval >= 1
    # validate_args asks the CUDA device for its architecture (grouped GEMM needs sm80+, CP's
    # connection setting depends on it): answer for the H200 these commands are for
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    if hasattr(ARGUMENTS, "get_device_arch_version"):
        monkeypatch.setattr(ARGUMENTS, "get_device_arch_version", lambda: 9)
    ARGUMENTS.validate_args(args, {})
    assert args.data_parallel_size == world // (cfg.mesh.pp * cfg.mesh.cp)


@pytest.mark.parametrize("model", MODELS)
def test_architecture_comes_from_the_preset(model):
    cfg = composed(f"model={model}")
    argv, m = megatron_argv(cfg), cfg.model
    assert flag(argv, "--num-layers") == str(m.num_layers)
    assert flag(argv, "--hidden-size") == str(m.hidden)
    assert flag(argv, "--num-experts") == str(m.num_experts)
    assert flag(argv, "--moe-router-topk") == str(m.top_k)
    assert flag(argv, "--moe-ffn-hidden-size") == str(m.expert_ffn)
    assert flag(argv, "--vocab-size") == str(m.vocab_size)
    assert float(flag(argv, "--rotary-base")) == m.rope_theta
    if m.num_kv_heads != m.num_heads:
        assert flag(argv, "--num-query-groups") == str(m.num_kv_heads)
    assert ("--qk-layernorm" in argv) == bool(m.qk_norm)
    if m.num_shared_experts:
        width = m.num_shared_experts * m.shared_expert_ffn
        assert flag(argv, "--moe-shared-expert-intermediate-size") == str(width)
    if m.dense_layers:
        dense, rest = m.dense_layers, m.num_layers - m.dense_layers
        assert flag(argv, "--moe-layer-freq") == f"([0]*{dense}+[1]*{rest})"
        assert flag(argv, "--ffn-hidden-size") == str(m.dense_ffn)
    for required in ("--mock-data", "--log-throughput", "--moe-router-force-load-balancing"):
        assert required in argv


def test_mesh_shapes_fp8_and_extra_args():
    cfg = composed("model=qwen3-30b-a3b", "mesh=pp2_ep4", "dtype=fp8", "routing=real",
                   "trainer.extra_args=[--use-distributed-optimizer]")  # fmt: skip
    argv = megatron_argv(cfg)
    assert flag(argv, "--pipeline-model-parallel-size") == "2"
    assert flag(argv, "--expert-model-parallel-size") == "4"
    assert flag(argv, "--fp8-format") == "hybrid"
    assert "--moe-router-force-load-balancing" not in argv
    assert argv[-1] == "--use-distributed-optimizer"
    launch = Megatron().launch(cfg, Path("arm"), Path("arm/config.yaml"), Path("wt"))
    assert launch.log_format == "megatron" and launch.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    # the runner lays torch.compile's caches under every adapter's environment; trainer.env wins
    env = compile_cache.under(cfg, Path("wt"), launch.env)
    assert env["TORCHINDUCTOR_CACHE_DIR"].endswith("/inductor")
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    mine = composed("model=qwen3-30b-a3b", "+trainer.env.TORCHINDUCTOR_CACHE_DIR=/mine")
    launch = Megatron().launch(mine, Path("arm"), Path("arm/config.yaml"), Path("wt"))
    assert compile_cache.under(mine, Path("wt"), launch.env)["TORCHINDUCTOR_CACHE_DIR"] == "/mine"


@pytest.mark.slow
def test_check_needs_a_megatron_lm_checkout(tmp_path):
    repo = tmp_path / "repo"
    (repo / "megatron/training").mkdir(parents=True)
    (repo / "megatron/training/arguments.py").write_text("")
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "m"]):
        subprocess.run(["git", "-C", str(repo), *args], check=True)
    cfg = composed("model=qwen3-30b-a3b", "refs.base=main", "refs.feat=main")
    with pytest.raises(PrerequisiteError, match=r"no pretrain_gpt.py .*Megatron-LM checkout"):
        Megatron().check(cfg, repo)
    (repo / "pretrain_gpt.py").write_text("")
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(repo), "commit", "-q", "-m", "script"], check=True)
    Megatron().check(cfg, repo)


def test_no_evaluation_but_an_eval_interval_for_megatrons_sample_count():
    """Megatron-LM (d98e8a6) computes train_iters // eval_interval + 1 evaluations even with
    --eval-iters 0, and its eval_interval defaults to None: without the flag every arm died in
    dataset building (TypeError: unsupported operand type(s) for //: 'int' and 'NoneType')."""
    cfg = composed("model=qwen3-30b-a3b", "training.max_steps=6")
    argv = megatron_argv(cfg)
    assert flag(argv, "--eval-iters") == "0"
    assert int(flag(argv, "--train-iters")) // int(flag(argv, "--eval-interval")) == 1


def test_local_layers_turn_persist_layer_norm_off():
    """--transformer-impl local norms RMSNorm with torch (WrappedTorchNorm), which asserts
    `not persist_layer_norm`, Megatron's default (seen on an H200 at Megatron-LM d98e8a6)."""
    local = megatron_argv(composed("model=qwen3-30b-a3b", "trainer.transformer_impl=local"))
    assert flag(local, "--transformer-impl") == "local" and "--no-persist-layer-norm" in local
    te = megatron_argv(composed("model=qwen3-30b-a3b"))
    assert flag(te, "--transformer-impl") == "transformer_engine"
    assert "--no-persist-layer-norm" not in te


@pytest.mark.slow
def test_no_dropout_as_in_the_presets_and_the_reference_trainer():
    """Megatron's defaults drop 10% of attention probabilities and hidden states (Megatron-LM
    d98e8a6 printed attention_dropout 0.1, hidden_dropout 0.1 for the command without these)."""
    for model in MODELS:
        argv = megatron_argv(composed(f"model={model}"))
        assert float(flag(argv, "--attention-dropout")) == 0.0
        assert float(flag(argv, "--hidden-dropout")) == 0.0


@pytest.mark.slow
def test_bench_script_plants_the_spin_before_the_optimizer_step_and_interleaves_repeats(tmp_path):
    """bench/bench_megatron.sh on a stand-in tree with train_step's optimizer.step() line, as a
    dry run (CYCLES given, so no GPU): the planted branch spins right before that line, and
    REPEATS=0,1 runs base, feat, base, feat."""
    tree = tmp_path / "mlm"
    (tree / "megatron/training").mkdir(parents=True)
    (tree / "pretrain_gpt.py").write_text("")
    (tree / "megatron/training/arguments.py").write_text("")
    step = "        update_successful, grad_norm, num_zeros_in_grad = optimizer.step()\n"
    (tree / "megatron/training/training.py").write_text(f"def train_step():\n{step}")
    env = {**os.environ, "CYCLES": "1234", "REPEATS": "0,1", "SWEEPS": "mlm_planted",
           "EXTRA": "dry_run=true", "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}  # fmt: skip
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(ROOT / "bench/bench_megatron.sh"), str(tree), str(out), "30"],
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    bench = (out / "bench.txt").read_text()
    assert "30 ms = 1234 spin cycles" in bench
    repo = re.search(r"megatron-lm repo: (\S+) ", bench).group(1)
    planted = subprocess.run(["git", "-C", repo, "show", "planted:megatron/training/training.py"],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert planted.endswith(
        "        torch.cuda._sleep(1234)  # moe_perf bench: planted slowdown\n" + step
    )
    # a dry run prints the first pair's two arms and says what the repeats will run
    jobs = re.findall(r"#\d+ : .*? arm=(\w+) repeat=(\d)", run.stdout)
    assert jobs == [("base", "0"), ("feat", "0")]
    assert "1 cell(s) x 2 fixed pair(s) in ABBA order" in run.stdout


def test_routing_balanced_and_real_map_to_megatrons_router_and_skew_is_refused(tmp_path):
    assert "--moe-router-force-load-balancing" in megatron_argv(composed("routing=balanced"))
    assert "--moe-router-force-load-balancing" not in megatron_argv(composed("routing=real"))
    skew = composed("model=qwen3-30b-a3b", "routing=skew")
    for call in (lambda: Megatron().check(skew, tmp_path), lambda: megatron_argv(skew)):
        with pytest.raises(PrerequisiteError, match="trainer=megatron: routing=skew needs a "
                           "planned per-expert assignment"):  # fmt: skip
            call()
