"""Config composition: every option file of every group, the tag, dp inference, packaging."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers.compose import composed
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from moe_perf.common.mesh import MeshDims
from moe_perf.runner.app import flags_first
from moe_perf.runner.schema import mesh_dims, repeat_suffix

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
GROUPS = ("model", "mesh", "dtype", "arm", "trainer", "launcher")


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "group,option", [(group, option) for group in GROUPS for option in options(group)]
)
def test_every_option_file_composes_and_resolves(group, option):
    cfg = composed(f"{group}={option}")
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert resolved[group]["name"] if group != "mesh" else resolved["mesh"]["nproc_per_node"]
    assert resolved["tag"].startswith(f"pp{cfg.mesh.pp}-dp")


@pytest.mark.parametrize(
    "overrides,micro",
    [
        ((), 4),  # one rank: 32 sequences in 8 micro-batches of 4
        (("mesh=ep2", "training.global_batch=4"), 2),  # 2 sequences per data rank
        (("mesh=pp2_ep2", "training.global_batch=8"), 2),  # 4 per rank, >= pp=2 micro-batches
        (("mesh=pp2_ep2", "training.global_batch=12"), 3),
        (("mesh=ep2", "training.global_batch=10"), 1),  # 5 per rank: no divisor in 2..4
        (("training.micro_batch=1",), 1),  # an explicit value wins
        (("model=qwen3-30b-a3b",), 1),  # the GPU presets keep one sequence per micro-batch
    ],
)
def test_the_cpu_workload_takes_the_largest_micro_batch_that_fits(overrides, micro):
    cfg = composed(*overrides)
    assert cfg.training.micro_batch == micro
    dims = mesh_dims(cfg.mesh)
    dims.check_batch(cfg.training.global_batch, cfg.training.micro_batch)  # never refused


def test_defaults():
    cfg = composed()
    assert (cfg.model.name, cfg.dtype.name, cfg.arm.name) == ("tiny", "fp32", "base")
    assert (cfg.trainer.name, cfg.launcher.name) == ("reference", "local")
    assert mesh_dims(cfg.mesh) == MeshDims(world=1)
    assert cfg.refs.base == "main" and cfg.repeat == 0 and cfg.repo == "."
    t = cfg.training
    assert (t.sequence_length, t.global_batch, t.micro_batch, t.max_steps) == (512, 32, 4, 8)
    assert t.device == "auto" and cfg.routing.mode == "balanced"
    assert cfg.data.corpus is None and cfg.data.root == "workspace/datasets"
    assert cfg.wandb.mode == "auto"
    assert list(cfg.trainer.command) == ["-m", "moe_perf.trainer"]
    assert cfg.tag == "pp1-dp1-cp1-ep1-seq512-fp32"


@pytest.mark.slow
def test_refs_feat_defaults_to_the_checked_out_branch(repo, monkeypatch):
    monkeypatch.chdir(repo)
    assert composed().refs.feat == "main"
    subprocess.run(["git", "-C", str(repo), "checkout", "-q", "--detach"], check=True)
    sha = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert composed().refs.feat == sha
    assert composed("refs.feat=other").arm.ref == "main"
    assert composed("arm=feat", "refs.feat=other").arm.ref == "other"


def test_tag_of_the_issue_example():
    cfg = composed("model=qwen3-30b-a3b", "mesh=pp2_ep8")
    assert cfg.tag == "pp2-dp8-cp1-ep8-seq2048-bf16"
    assert composed("mesh=pp2_ep8", "dtype=fp8").tag == "pp2-dp8-cp1-ep8-seq512-fp8"
    assert composed("mesh=cp2_ep4", "training.sequence_length=4096").tag == (
        "pp1-dp4-cp2-ep4-seq4096-fp32"
    )


@pytest.mark.parametrize("mesh", options("mesh"))
def test_dp_is_inferred_and_the_default_batch_fits_every_mesh(mesh):
    cfg = composed(f"mesh={mesh}")
    dims = mesh_dims(cfg.mesh)
    assert "dp" not in cfg.mesh  # never a field
    assert dims.dp == dims.world // (dims.pp * dims.cp)
    assert f"-dp{dims.dp}-" in cfg.tag
    dims.check_layout()
    dims.check_sequence(cfg.training.sequence_length)
    dims.check_batch(cfg.training.global_batch, cfg.training.micro_batch)


@pytest.mark.parametrize("model", [m for m in options("model") if m != "tiny"])
@pytest.mark.parametrize("mesh", options("mesh"))
def test_every_model_fits_every_mesh(model, mesh):
    cfg = composed(f"model={model}", f"mesh={mesh}")
    mesh_dims(cfg.mesh).check_experts(cfg.model.num_experts)


def test_schema_types_reject_a_wrong_value():
    with pytest.raises(ConfigCompositionException):
        composed("training.max_steps=eight")
    with pytest.raises(ConfigCompositionException):
        composed("mesh.ep=two")


def test_arm_directory_names(tmp_path):
    cfg = composed("model=qwen3-30b-a3b", "mesh=ep8", "arm=feat", hydra_config=True)
    assert cfg.hydra.sweep.dir == "outputs/validate-performance"
    assert cfg.hydra.sweep.subdir == "qwen3-30b-a3b/pp1-dp8-cp1-ep8-seq2048-bf16-feat"
    assert cfg.hydra.run.dir.endswith(
        "validate-performance/qwen3-30b-a3b/pp1-dp8-cp1-ep8-seq2048-bf16-feat"
    )
    swept = composed("repeat=0", hydra_config=True)  # set by the sweep: always in the name
    assert swept.hydra.sweep.subdir.endswith("-base-r0")


def test_repeat_suffix():
    assert repeat_suffix(0, []) == ""
    assert repeat_suffix(2, []) == "-r2"
    assert repeat_suffix(0, ["arm=base", "repeat=0"]) == "-r0"


def test_multirun_flag_may_follow_overrides():
    assert flags_first(["model=x", "-m", "arm=base,feat"]) == ["-m", "model=x", "arm=base,feat"]
    assert flags_first(["trainer.command=[-m,t]"]) == ["trainer.command=[-m,t]"]


@pytest.mark.slow
def test_the_command_prints_the_tag():
    out = subprocess.run(
        [sys.executable, "-m", "moe_perf", "model=qwen3-30b-a3b", "mesh=pp2_ep8", "--cfg", "job",
         "--resolve"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout  # fmt: skip
    assert "tag: pp2-dp8-cp1-ep8-seq2048-bf16" in out.splitlines()


def test_every_package_is_listed_in_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "moe_perf").rglob("__init__.py")
    }
    assert found | {"moe_perf.conf"} <= listed


@pytest.mark.slow
def test_a_built_wheel_carries_the_configs(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
         str(tmp_path), str(ROOT)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("moe_perf-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"moe_perf/conf/{p.relative_to(CONF)}" for p in CONF.rglob("*.yaml")}
    assert expected <= names
    assert "moe_perf/conf/__init__.py" in names and "moe_perf/runner/app.py" in names


# --- one set of config dataclasses, typed group schemas ---------------------------------------


def test_the_schema_is_the_trainers_dataclasses():
    """The runner's Hydra schema types the sections with the trainer's own classes, and what
    the runner composes is what the trainer reads when a key is left out: one set of defaults."""
    from dataclasses import fields

    from moe_perf.common import config as trainer_config
    from moe_perf.runner.schema import MoePerfConfig, ReferenceTrainerSchema

    types = {f.name: f.type for f in fields(MoePerfConfig)}
    for section in ("model", "mesh", "dtype", "training", "data", "routing"):
        assert types[section] == f"{section.capitalize()}Config"
        assert MoePerfConfig.__annotations__[section] == types[section]
    assert issubclass(ReferenceTrainerSchema, trainer_config.TrainerConfig)

    cfg = composed("model=qwen3-30b-a3b", "dtype=bf16")  # a preset that sets no training values
    sections = ("mesh", "dtype", "training", "data", "trainer", "routing")
    resolved = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in sections}
    read = trainer_config.config_from_dict(
        {"model": OmegaConf.to_container(cfg.model, resolve=True)}
    )  # every section but the model left to the dataclass defaults
    for section in sections:
        defaults = vars(getattr(read, section))
        assert {k: resolved[section][k] for k in defaults} == defaults, section


@pytest.mark.parametrize("group", ["trainer", "launcher"])
def test_every_option_has_its_own_schema(group):
    from moe_perf.runner.schema import OPTION_SCHEMAS

    assert set(OPTION_SCHEMAS[group]) == set(options(group))
    for option in options(group):
        overrides = [f"{group}={option}"] + (["trainer.command=[x]"] if option == "command" else [])
        node = composed(*overrides)[group]
        assert OmegaConf.get_type(node) is OPTION_SCHEMAS[group][option]
        # the name's one home is the schema: the option file names its schema, never itself
        assert node.name == option
        assert "name" not in (OmegaConf.load(CONF / group / f"{option}.yaml") or {})


def test_every_launcher_stops_an_arm_with_one_default_grace():
    from moe_perf.launchers.base import KILL_GRACE_S

    for option in options("launcher"):
        assert composed(f"launcher={option}").launcher.kill_grace_s == KILL_GRACE_S
        assert "kill_grace_s" not in OmegaConf.load(CONF / "launcher" / f"{option}.yaml")


@pytest.mark.parametrize(
    "override,key",
    [("model.num_experts=abc", "model.num_experts"), ("trainer.compile=maybe", "trainer.compile"),
     ("mesh.pp=two", "mesh.pp"), ("launcher.kill_grace_s=soon", "launcher.kill_grace_s")],
)  # fmt: skip
def test_a_wrong_type_fails_at_compose_time(override, key):
    with pytest.raises(ConfigCompositionException) as err:
        composed(override)
    assert key in str(err.value.__cause__)


def run_command(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moe_perf", *overrides, "wandb.mode=disabled"],
        capture_output=True, text=True, cwd=cwd, timeout=120,
    )  # fmt: skip


@pytest.mark.slow
def test_the_command_prints_hydras_message_for_a_wrong_type(tmp_path):
    result = run_command(tmp_path, "model.num_experts=abc")
    assert result.returncode == 1
    assert "Error merging override model.num_experts=abc" in result.stderr
    assert "Value 'abc' of type 'str' could not be converted to Integer" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "outputs").exists()  # compose


UNKNOWN_KEYS = {
    # the typo of Hydra's own suggestion, "To append to your config use +training.max_steps"
    "+trainingg.max_steps=4": "trainingg is not a key of the config (did you mean training?)",
    "+trainer.compil=true": "trainer.compil is not a key of the trainer section (did you mean "
    "trainer.compile?)",
    "+model.num_expert=4": "(did you mean model.num_experts?)",
    "+launcher.kill_grace=3": "(did you mean launcher.kill_grace_s?)",
    "+data.corpuss=x": "data.corpuss is not a key of the data section",
}


@pytest.mark.slow
@pytest.mark.parametrize("override", list(UNKNOWN_KEYS))
def test_an_unknown_key_is_refused_through_the_real_command(tmp_path, override):
    """`+key=value` adds a key even to a typed section (Hydra force-adds): refused before the
    sweep looks at the repository (tmp_path is none), nothing written."""
    result = run_command(tmp_path, override)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "cannot run" in line]
    assert UNKNOWN_KEYS[override] in line and "remove or correct it" in line
    assert_nothing_written(tmp_path)


def assert_nothing_written(cwd: Path) -> None:
    """No file, and no directory but an empty outputs/ (Hydra creates the job's directory
    before moe_perf runs; the refused job removes it up to outputs/)."""
    assert [p for p in cwd.rglob("*") if p.is_file()] == []
    assert not (cwd / "outputs" / "validate-performance").exists()


def test_an_unknown_key_of_another_trainer_option():
    from moe_perf.runner.preflight import PrerequisiteError, check_config

    check_config(composed("trainer=torchtitan", "trainer.compile=true"))
    with pytest.raises(PrerequisiteError, match="trainer.pp_schedule is not a key"):
        check_config(composed("trainer=torchtitan", "+trainer.pp_schedule=1F1B"))
    check_config(composed("trainer=torchtitan", "+trainer.env.HF_HOME=/x"))  # a free-form map
