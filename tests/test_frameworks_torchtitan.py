"""trainer=torchtitan: the command line each arm gets, read back by torchtitan's own parser.

The arm's code is a real torchtitan tree: the installed torchtitan package (its files decide
the CLI, as a worktree's would), copied into a git repository for the checks that read a
commit. torchtitan's ConfigManager (the installed version's) parses every generated command,
for every model preset x mesh preset, and the parsed JobConfig must hold what the composed
config says. torchtitan cannot train on CPU, so the run itself is a GPU check (bench/).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.compose import composed as compose_config

from moe_perf.common.armcode import ArmCode
from moe_perf.common.errors import PrerequisiteError
from moe_perf.frameworks.torchtitan import (
    MODELS,
    OFFLINE_ENV,
    REGISTRY_CLI,
    TOML_CLI,
    TorchTitan,
    titan_cli,
)

ROOT = Path(__file__).resolve().parents[1]
MESHES = sorted(p.stem for p in (ROOT / "conf" / "mesh").glob("*.yaml"))


def composed(*overrides: str):
    """The config with trainer=torchtitan; `overrides` come after, as on a command line."""
    return compose_config("trainer=torchtitan", *overrides)


def installed_torchtitan() -> tuple[Path, str] | None:
    """(the folder holding the installed `torchtitan` package, its CLI), or None."""
    spec = importlib.util.find_spec("torchtitan")
    if spec is None or spec.origin is None:
        return None
    tree = Path(spec.origin).parent.parent
    return tree, titan_cli(ArmCode(tree))


INSTALLED = installed_torchtitan()
needs_torchtitan = pytest.mark.skipif(
    INSTALLED is None,
    reason="torchtitan is not installed (pip install --no-deps torchtitan==0.2.2 tyro==1.0.17 "
    "docstring_parser typeguard triton==3.6.0; its config imports its MoE triton kernels): its "
    "own parser checks the command lines",
)


def titan_args(argv: list[str]) -> list[str]:
    """torchtitan's flags: after `-m torchtitan.train`, or after our entry's `--`."""
    if argv[:2] == ["-m", "torchtitan.train"]:
        return argv[2:]
    assert argv[:2] == ["-m", "moe_perf.titan_entry"], argv
    return argv[argv.index("--") + 1 :]


def entry_args(argv: list[str]) -> dict[str, str]:
    ours = argv[2 : argv.index("--")]
    out, i = {}, 0
    while i < len(ours):
        if i + 1 < len(ours) and not ours[i + 1].startswith("--"):
            out[ours[i]], i = ours[i + 1], i + 2
        else:
            out[ours[i]], i = "", i + 1
    return out


def parse_with_torchtitan(args: list[str]):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(list(args))


@pytest.mark.slow
@needs_torchtitan
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_preset_command_is_accepted_by_torchtitans_own_parser(model, mesh, tmp_path):
    tree, cli = INSTALLED
    if cli != TOML_CLI:
        pytest.skip(f"the installed torchtitan speaks the {cli} CLI; this checks 0.2's JobConfig")
    cfg = composed(f"model={model}", f"mesh={mesh}", "model.num_layers=4")
    launch = TorchTitan().launch(cfg, tmp_path / "arm", tmp_path / "arm/config.yaml", tree)
    job = parse_with_torchtitan(titan_args(launch.argv))
    m, t = cfg.mesh, cfg.training
    dp = m.nnodes * m.nproc_per_node // (m.pp * m.cp)
    p = job.parallelism
    assert (p.pipeline_parallel_degree, p.context_parallel_degree, p.expert_parallel_degree) == (
        m.pp, m.cp, m.ep)  # fmt: skip
    assert (p.data_parallel_shard_degree, p.tensor_parallel_degree) == (-1, 1)
    assert (job.training.seq_len, job.training.steps) == (t.sequence_length, t.max_steps)
    assert job.training.global_batch_size == t.global_batch
    if m.pp > 1:  # the rank's share of the step, split by the schedule into micro-batches
        assert job.training.local_batch_size == t.global_batch // dp
        assert p.pipeline_parallel_microbatch_size == t.micro_batch
    else:  # torchtitan accumulates gradients over global / (local * dp) passes
        assert job.training.local_batch_size == t.micro_batch
    assert job.debug.moe_force_load_balance is True and job.debug.seed == t.seed
    assert job.metrics.log_freq == 1 and job.checkpoint.enable is False
    assert job.model.name == MODELS[model].name
    # the cut depth reaches torchtitan as a derived flavor the entry registers
    assert job.model.flavor == f"{MODELS[model].flavor}-4layers"
    entry = entry_args(launch.argv)
    assert entry == {"--cli": "0.2", "--model": MODELS[model].name,
                     "--base": MODELS[model].flavor, "--as": job.model.flavor,
                     "--num-layers": "4"}  # fmt: skip
    assert job.model.hf_assets_path == "tests/assets/tokenizer"
    assert (job.training.dataset, job.training.dataset_path) == ("c4_test", "tests/assets/c4_test")
    assert job.job.dump_folder == str(tmp_path / "arm" / "torchtitan")
    assert launch.log_format == "torchtitan"
    assert OFFLINE_ENV.items() <= launch.env.items()


@needs_torchtitan
def test_full_depth_fp8_unbalanced_and_extra_args_reach_torchtitan(tmp_path):
    tree, cli = INSTALLED
    if cli != TOML_CLI:
        pytest.skip(f"the installed torchtitan speaks the {cli} CLI")
    cfg = composed(
        "model=qwen3-30b-a3b", "mesh=ep8", "dtype=fp8", "routing=real",
        "trainer.compile=true", "trainer.extra_args=[--training.steps,20,--compile.no-enable]",
    )  # fmt: skip
    launch = TorchTitan().launch(cfg, tmp_path, tmp_path / "config.yaml", tree)
    assert launch.argv[:2] == ["-m", "torchtitan.train"]  # nothing to register at full depth
    job = parse_with_torchtitan(titan_args(launch.argv))
    assert job.model.flavor == "30B-A3B"
    assert job.model.converters == ["quantize.linear.float8"]
    assert job.debug.moe_force_load_balance is False
    assert job.training.steps == 20 and job.compile.enable is False  # extra_args win


def test_cli_is_read_from_the_arms_own_files(tmp_path):
    with pytest.raises(PrerequisiteError, match="no torchtitan in .*run from a torchtitan"):
        titan_cli(ArmCode(tmp_path))
    (tmp_path / "torchtitan/config").mkdir(parents=True)
    (tmp_path / "torchtitan/trainer.py").write_text("")
    (tmp_path / "torchtitan/config/manager.py").write_text("")
    assert titan_cli(ArmCode(tmp_path)) == REGISTRY_CLI
    (tmp_path / "torchtitan/config/job_config.py").write_text("")
    assert titan_cli(ArmCode(tmp_path)) == TOML_CLI


def registry_tree(root: Path) -> None:
    """The files by which an arm's torchtitan is read as 0.3 (the --module/--config CLI)."""
    for path in ("torchtitan/trainer.py", "torchtitan/config/manager.py"):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("")


def test_registry_cli_command_for_a_03_tree(tmp_path):
    """0.3's --module/--config, a derived config for the cut depth and fp8 (its CLI has no
    float8 flag), CUDA graphs off under PP; checked against 0.3's own parser when installed."""
    registry_tree(tmp_path)
    cfg = composed("model=deepseek-v2-lite", "mesh=pp2_ep4", "model.num_layers=4", "dtype=fp8")
    launch = TorchTitan().launch(cfg, tmp_path / "arm", tmp_path / "c.yaml", tmp_path)
    args = titan_args(launch.argv)
    assert args[:4] == ["--module", "deepseek_v3", "--config", "deepseek_v3_16b_4layers_fp8"]
    assert entry_args(launch.argv) == {"--cli": "0.3", "--model": "deepseek_v3",
                                       "--base": "deepseek_v3_16b",
                                       "--as": "deepseek_v3_16b_4layers_fp8",
                                       "--num-layers": "4", "--float8": ""}  # fmt: skip
    assert "--training.disable_cuda_graphs" in args
    assert "--dataloader.dataset" in args and "--hf_assets_path" in args
    assert args[-1] == "activation-checkpoint:none"  # a subcommand of 0.3's CLI: last
    ep_only = TorchTitan().launch(composed("model=qwen3-30b-a3b", "mesh=ep4"), tmp_path / "arm",
                                  tmp_path / "c.yaml", tmp_path)  # fmt: skip
    assert "--training.disable_cuda_graphs" in titan_args(ep_only.argv)


# torchtitan 0.3 in CI would need its data pipeline (datasets, pyarrow, torchdata), fla,
# torchvision and more, all imported by its config registry: this check runs where they are
TITAN_03 = os.environ.get("MOE_PERF_TORCHTITAN_03")
PARSE_03 = """
import json, sys
from moe_perf.titan_entry import register_config
out = []
for ours, args in json.load(sys.stdin):
    register_config(ours["--model"], ours["--base"], ours["--as"], int(ours["--num-layers"]),
                    "--float8" in ours, False)
    from torchtitan.config import ConfigManager
    job = ConfigManager().parse_args(args)
    p, t = job.parallelism, job.training
    out.append({"degrees": [p.pipeline_parallel_degree, p.context_parallel_degree,
                            p.expert_parallel_degree, p.data_parallel_shard_degree,
                            p.tensor_parallel_degree],
                "seq": t.seq_len, "steps": t.steps, "global": t.global_batch_size,
                "local": t.local_batch_size, "micro": p.pipeline_parallel_microbatch_size,
                "no_graphs": t.disable_cuda_graphs, "ac": job.activation_checkpoint is None,
                "balance": job.debug.moe_force_load_balance, "log_freq": job.metrics.log_freq,
                "layers": len(job.model_spec.model.layers), "dump": job.dump_folder})
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(
    not TITAN_03,
    reason="MOE_PERF_TORCHTITAN_03 is not set: point it (a PYTHONPATH) at torchtitan 0.3.0 and "
    "what its config imports (pip install --no-deps --target DIR torchtitan==0.3.0 "
    "spmd_types==0.2.3 torch_checkpointing tensorboard absl-py fla-core einops safetensors "
    "torchdata, plus "
    "'datasets<4.8,>=3.6' with its dependencies)",
)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_preset_command_is_accepted_by_torchtitan_03s_own_parser(model, tmp_path):
    """0.3's ConfigManager, after the derived config our entry registers, reads every mesh's
    command; its own checks run too (CUDA graphs refused under PP and EP, batch arithmetic)."""
    tree = tmp_path / "titan03"  # the CLI is read from the arm's files, as in a 0.3 worktree
    registry_tree(tree)
    cfgs = [composed(f"model={model}", f"mesh={m}", "model.num_layers=4") for m in MESHES]
    launches = [TorchTitan().launch(c, tmp_path / "arm", tmp_path / "c.yaml", tree) for c in cfgs]
    job = json.dumps([[entry_args(la.argv), titan_args(la.argv)] for la in launches])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TITAN_03, str(ROOT)])}
    run = subprocess.run([sys.executable, "-c", PARSE_03], input=job, env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    if run.returncode and "torchtitan/models/" in run.stderr and "Error" in run.stderr:
        last = run.stderr.strip().splitlines()[-1]
        if "does not exist" in last or "No module named" in last:  # a model's own import
            pytest.skip(f"torchtitan 0.3's {MODELS[model].name} does not import here: {last}")
    assert run.returncode == 0, run.stderr[-3000:]
    for cfg, got in zip(cfgs, json.loads(run.stdout), strict=True):
        m, t = cfg.mesh, cfg.training
        dp = m.nnodes * m.nproc_per_node // (m.pp * m.cp)
        assert got["degrees"] == [m.pp, m.cp, m.ep, -1, 1], m
        assert (got["seq"], got["steps"], got["global"]) == (
            t.sequence_length, t.max_steps, t.global_batch)  # fmt: skip
        if m.pp > 1:
            assert (got["local"], got["micro"]) == (t.global_batch // dp, t.micro_batch)
        else:
            assert got["local"] == t.micro_batch
        if m.pp > 1 or m.ep > 1:  # else the config's own choice stands
            assert got["no_graphs"] is True
        assert got["ac"] and got["balance"] is True and got["log_freq"] == 1
        assert got["layers"] == 4 and got["dump"] == str(tmp_path / "arm" / "torchtitan")


# --- preflight: the checks that read the arm's commit --------------------------------------


@pytest.fixture
def titan_repo(tmp_path):
    """A git repository holding the installed torchtitan's code and local test assets."""
    if INSTALLED is None:
        pytest.skip("torchtitan is not installed: its code is the repository here")
    repo = tmp_path / "torchtitan"
    shutil.copytree(INSTALLED[0] / "torchtitan", repo / "torchtitan",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    (repo / "tests/assets/tokenizer").mkdir(parents=True)
    (repo / "tests/assets/tokenizer/tokenizer.json").write_text("{}")
    (repo / "tests/assets/c4_test").mkdir(parents=True)
    (repo / "tests/assets/c4_test/data.json").write_text('{"text": "a b c"}\n')
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "titan"]):
        subprocess.run(["git", "-C", str(repo), *args], check=True)
    return repo


def check(repo: Path, *overrides: str) -> None:
    TorchTitan().check(composed("refs.base=main", "refs.feat=main", *overrides), repo)


@pytest.mark.slow
def test_check_passes_on_a_torchtitan_checkout(titan_repo):
    check(titan_repo, "model=qwen3-30b-a3b", "mesh=ep8", "model.num_layers=4")
    check(titan_repo, "model=deepseek-v2-lite", "mesh=pp2_ep8")  # deepseek_v3 pipelines in 0.2


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model=tiny"], r"model=tiny has no torchtitan flavor"),
        (["model=qwen3-30b-a3b", "model.num_layers=60"], r"model.num_layers=60: .* 48 layers"),
        (["model=qwen3.5-35b-a3b"], r"has no torchtitan/models/qwen3_5"),
        (["model=qwen3-30b-a3b", "mesh=pp2_ep8"], r"mesh.pp=2: .*qwen3 .*does not support pipe"),
        (["model=qwen3-30b-a3b", "trainer.tokenizer=assets/hf/Qwen3"], r"trainer.tokenizer="),
        (["model=qwen3-30b-a3b", "trainer.dataset=c4", "trainer.dataset_path=null"],
         r"trainer.dataset=c4 would be downloaded from the hub: set trainer.dataset_path"),
        (["model=qwen3-30b-a3b", "trainer.dataset_path=/nonexistent/c4"],
         r"trainer.dataset_path=/nonexistent/c4: no dataset there"),
    ],
)  # fmt: skip
def test_check_names_the_setting_to_change(titan_repo, overrides, message):
    with pytest.raises(PrerequisiteError, match=message):
        check(titan_repo, *overrides)


@pytest.mark.slow
def test_check_reads_the_arms_commit_not_the_checkout(titan_repo):
    """The feat branch lost its tokenizer: its arm is refused, though main still has it."""

    def run(*args):
        subprocess.run(["git", "-C", str(titan_repo), *args], check=True)

    run("checkout", "-q", "-b", "feat")
    run("rm", "-q", "-r", "tests/assets/tokenizer")
    run("commit", "-q", "-m", "no tokenizer")
    run("checkout", "-q", "main")
    base = ["model=qwen3-30b-a3b", "refs.base=main", "refs.feat=feat"]
    TorchTitan().check(composed(*base, "arm=base"), titan_repo)
    with pytest.raises(PrerequisiteError, match=r"trainer.tokenizer=.*at feat in"):
        TorchTitan().check(composed(*base, "arm=feat"), titan_repo)


def test_check_host_counts_cuda_devices():
    cfg = composed("model=qwen3-30b-a3b", "mesh=ep8")
    if shutil.which("nvidia-smi"):
        pytest.skip("this host has nvidia-smi; the no-GPU message is checked elsewhere")
    with pytest.raises(PrerequisiteError, match=r"needs mesh.nproc_per_node=8 CUDA devices"):
        TorchTitan().check_host(cfg)


def test_trainer_torchtitan_and_megatron_are_registered():
    from moe_perf import frameworks
    from moe_perf.frameworks.megatron import Megatron

    assert isinstance(frameworks.get(composed()), TorchTitan)
    assert isinstance(frameworks.get(composed("trainer=megatron")), Megatron)


@pytest.mark.slow
def test_dry_run_prints_the_exact_command_from_the_arms_worktree(
    titan_repo, tmp_path, capsys, monkeypatch
):
    from moe_perf import frameworks
    from moe_perf.report.sweep import Sweep
    from moe_perf.runner.dryrun import WORKTREE, check_host, preview_arm
    from moe_perf.runner.job import Job

    sha = subprocess.run(["git", "-C", str(titan_repo), "rev-parse", "HEAD"], check=True,
                         capture_output=True, text=True).stdout.strip()  # fmt: skip
    cfg = composed("model=qwen3-30b-a3b", "mesh=ep8", "model.num_layers=4",
                   "refs.base=main", "refs.feat=main")  # fmt: skip
    sweep = Sweep("s1", str(tmp_path / "sweep"), str(titan_repo), {"base": "main", "feat": "main"},
                  {"base": sha, "feat": sha}, "now")  # fmt: skip
    job = Job(arm_dir=tmp_path / "sweep/arm", sweep_dir=tmp_path / "sweep", cwd=titan_repo)
    # independent of the registration, which the test above checks
    monkeypatch.setitem(frameworks.FRAMEWORKS, "torchtitan", TorchTitan)
    check_host(cfg, dry_run=True)  # no GPU here: a warning, not an error
    plan = preview_arm(cfg, job, sweep, "base")
    out = capsys.readouterr()
    assert "torch.distributed.run" in plan["argv"][1:3]
    assert plan["argv"][plan["argv"].index("-m", 3) :][:2] == ["-m", "moe_perf.titan_entry"]
    assert "--model.flavor" in plan["argv"] and "30B-A3B-4layers" in plan["argv"]
    assert plan["env"]["HF_HUB_OFFLINE"] == "1"
    assert plan["env"]["PYTHONPATH"].startswith(WORKTREE)
    assert plan["cwd"].startswith(WORKTREE) and sha[:10] in plan["cwd"]
    assert "base: command " in out.out and "30B-A3B-4layers" in out.out
    if not shutil.which("nvidia-smi"):
        assert "warning (dry run" in out.err
    assert not job.arm_dir.exists()  # nothing written for the arm
    listed = subprocess.run(["git", "-C", str(titan_repo), "worktree", "list"], check=True,
                            capture_output=True, text=True).stdout  # fmt: skip
    assert len(listed.strip().splitlines()) == 1  # the worktree is gone again


# --- routing=skew: our plan inside torchtitan's own router ---------------------------------


@needs_torchtitan
def test_skew_runs_our_entry_and_torchtitans_router_sends_by_the_plan(tmp_path, monkeypatch):
    """The command selects torchtitan's forced routing and our entry with the plan's knobs;
    the entry's replacement, installed in the installed torchtitan, makes its router (a real
    TokenChoiceTopKRouter, on CPU) send exactly the planned counts."""
    import torch

    from moe_perf.common.routing import skew_plan
    from moe_perf.titan_entry import (
        FORCED_ROUTING,
        expected_call,
        install_skew,
        parse,
        skew_request,
    )

    tree, cli = INSTALLED
    if cli != TOML_CLI:
        pytest.skip(f"the installed torchtitan speaks the {cli} CLI")
    cfg = composed("model=qwen3-30b-a3b", "mesh=ep4", "routing=skew", "routing.imbalance=4",
                   "routing.shape=zipf")  # fmt: skip
    launch = TorchTitan().launch(cfg, tmp_path, tmp_path / "config.yaml", tree)
    entry = entry_args(launch.argv)
    assert entry["--as"] == entry["--base"] == "30B-A3B"  # full depth: the entry for the plan
    assert (entry["--skew"], entry["--skew-shape"], entry["--skew-ep"]) == ("4.0", "zipf", "4")
    # a router call: one rank's micro-batch (1 x 2048 tokens), made before torchtitan compiles
    assert (entry["--skew-tokens"], entry["--skew-experts"], entry["--skew-top-k"]) == (
        "2048", "128", "8")  # fmt: skip
    job = parse_with_torchtitan(titan_args(launch.argv))
    assert job.debug.moe_force_load_balance is True

    from torchtitan.models.moe import moe as titan_moe

    router_cls = titan_moe.TokenChoiceTopKRouter
    monkeypatch.setattr(router_cls, FORCED_ROUTING, getattr(router_cls, FORCED_ROUTING))
    ours, _ = parse(launch.argv[2:])
    patched = install_skew(skew_request(ours), expected_call(ours))
    assert "torchtitan.models.moe.moe.TokenChoiceTopKRouter" in patched
    E, K, T = cfg.model.num_experts, cfg.model.top_k, 2048
    router = router_cls(dim=16, num_experts=E, num_expert_groups=None, num_limited_groups=None,
                        top_k=K, score_func="softmax", route_norm=True, route_scale=1.0,
                        gate_bias=False, _debug_force_load_balance=True)  # fmt: skip
    # what its forward calls under --debug.moe_force_load_balance (the forward itself ends in
    # torch.histc over int64 ids, which runs on CUDA only)
    scores_TE = router.gate(torch.randn(T, 16)).softmax(-1)
    ids, top_scores = getattr(router, FORCED_ROUTING)(scores_TE)
    plan = skew_plan(num_experts=E, top_k=K, tokens=T, ep=4, imbalance=4.0, shape="zipf")
    assert torch.bincount(ids.reshape(-1), minlength=E).tolist() == list(plan.counts)
    assert (ids.sort(1).values.diff(dim=1) > 0).all()  # K distinct experts per token
    assert torch.equal(top_scores, scores_TE.gather(1, ids))  # the router's real scores


@pytest.mark.slow
def test_skew_needs_the_forced_routing_method_in_the_arms_torchtitan(titan_repo):
    check(titan_repo, "model=qwen3-30b-a3b", "routing=skew")
    moe_py = titan_repo / "torchtitan/models/moe/moe.py"
    moe_py.write_text(moe_py.read_text().replace("_debug_force_load_balance_routing", "_gone"))
    subprocess.run(["git", "-C", str(titan_repo), "commit", "-qam", "no forced routing"],
                   check=True)  # fmt: skip
    check(titan_repo, "model=qwen3-30b-a3b", "routing=real")
    with pytest.raises(PrerequisiteError, match="routing=skew: the torchtitan at .* has no "
                       "router method _debug_force_load_balance_routing"):  # fmt: skip
        check(titan_repo, "model=qwen3-30b-a3b", "routing=skew")
