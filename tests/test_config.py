"""Config composition: every option file of every group, the tag, dp inference, packaging."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
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


def composed(*overrides: str, hydra_config: bool = False):
    with initialize_config_module(config_module="moe_perf.conf", version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra_config)


@pytest.mark.parametrize(
    "group,option", [(group, option) for group in GROUPS for option in options(group)]
)
def test_every_option_file_composes_and_resolves(group, option):
    cfg = composed(f"{group}={option}")
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert resolved[group]["name"] if group != "mesh" else resolved["mesh"]["nproc_per_node"]
    assert resolved["tag"].startswith(f"pp{cfg.mesh.pp}-dp")


def test_defaults():
    cfg = composed()
    assert (cfg.model.name, cfg.dtype.name, cfg.arm.name) == ("tiny", "bf16", "base")
    assert (cfg.trainer.name, cfg.launcher.name) == ("reference", "local")
    assert mesh_dims(cfg.mesh) == MeshDims(world=1)
    assert cfg.refs.base == "main" and cfg.repeat == 0 and cfg.repo == "."
    t = cfg.training
    assert (t.sequence_length, t.global_batch, t.micro_batch, t.max_steps) == (2048, 32, 1, 8)
    assert t.benchmark is True and t.device == "auto"
    assert cfg.data.corpus is None and cfg.data.root == "workspace/datasets"
    assert cfg.wandb.mode == "auto"
    assert list(cfg.trainer.command) == ["-m", "moe_perf.trainer"]
    assert cfg.tag == "pp1-dp1-cp1-ep1-seq2048-bf16"


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
