"""Every prerequisite violation: a short message naming what to change, exit code 2, nothing
launched and no arm directory left. Through the real command, in real git repositories."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.command import moe_perf, sweep_dir
from helpers.compose import composed
from helpers.repos import commit, git, write
from omegaconf import OmegaConf

from moe_perf.common.config import ConfigError, config_from_dict
from moe_perf.runner import preflight as validate

# (overrides, words the message must contain: the override to change and the arithmetic)
VIOLATIONS = {
    "world % pp": (["mesh.nproc_per_node=3", "mesh.pp=2"], ["mesh.pp", "world 3 % mesh.pp=2"]),
    "cp divides world/pp": (["mesh=ep2", "mesh.cp=4"], ["mesh.cp=4", "world/pp"]),
    "ep divides world/pp": (["mesh.nproc_per_node=3", "mesh.ep=2"], ["mesh.ep=2", "world/pp"]),
    "seq % 2cp": (["mesh=cp2_ep2", "training.sequence_length=66"], ["training.sequence_length"]),
    "batch per dp >= 2pp": (["mesh=pp2_ep2", "training.global_batch=4"], ["training.global_batch"]),
    "batch % dp": (["mesh=ep4", "training.global_batch=6"], ["training.global_batch=6", "dp"]),
    "micro batch": (["training.micro_batch=5"],
                    ["training.micro_batch=5", "global_batch % (dp*micro_batch) == 0 fails"]),
    "micro-batches >= pp": (["mesh=pp2_ep2", "training.micro_batch=16"],
                            ["training.micro_batch", "micro-batches per rank >= pp fails",
                             "global_batch/(dp*micro_batch) = 32/(2*16) = 1 < mesh.pp=2"]),
    "experts % ep": (["mesh=ep4", "model.num_experts=6"], ["model.num_experts=6", "mesh.ep=4"]),
    "corpus": (["data.corpus=dclm"], ["data.corpus=dclm", "moe_perf.trainer.data build"]),
    "one node locally": (["mesh=pp2_ep8"], ["mesh.nnodes=2", "launcher=local"]),
    "missing ref": (["refs.base=no-such-branch"], ["refs.base=no-such-branch"]),
    "max steps": (["training.max_steps=1"], ["training.max_steps"]),
}  # fmt: skip


def assert_nothing_launched(repo: Path) -> None:
    outputs = sweep_dir(repo)
    arm_dirs = [p for p in outputs.glob("*/*") if p.name != "previous"] if outputs.exists() else []
    assert arm_dirs == []
    assert not list(repo.rglob("console.log")) and not list(repo.rglob("metrics.json"))
    assert len(git(repo, "worktree", "list").splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VIOLATIONS))
def test_prerequisite_violation(repo, name):
    overrides, words = VIOLATIONS[name]
    result = moe_perf(repo, *overrides, "wandb.mode=disabled")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    message = next(line for line in result.stderr.splitlines() if "cannot run" in line)
    for word in words:
        assert word in message
    assert_nothing_launched(repo)


@pytest.mark.slow
def test_dirty_tree_untracked_counts_ignored_does_not(repo):
    commit(repo, {".gitignore": "scratch/\n"}, "ignore scratch")
    write(repo, {"scratch/notes.txt": "ignored\n"})
    write(repo, {"new_file.py": "untracked\n"})
    result = moe_perf(repo, "wandb.mode=disabled")
    assert result.returncode == 2
    assert "not clean" in result.stderr and "new_file.py" in result.stderr
    assert "`git stash -u`" in result.stderr  # a plain `git stash` leaves untracked files
    assert "scratch" not in result.stderr
    assert_nothing_launched(repo)

    (repo / "new_file.py").unlink()
    write(repo, {"README.md": "modified\n"})
    result = moe_perf(repo, "wandb.mode=disabled")
    assert result.returncode == 2 and "README.md" in result.stderr
    assert_nothing_launched(repo)


@pytest.mark.slow
def test_a_failing_job_stops_the_whole_sweep_before_any_arm(repo):
    result = moe_perf(repo, "model.num_experts=6", "-m", "mesh=single,ep4", "arm=base,feat")
    assert result.returncode == 2
    assert "2 job(s) of this sweep cannot run" in result.stderr
    assert "mesh=ep4" in result.stderr and "model.num_experts=6 % mesh.ep=4" in result.stderr
    assert "sweep is stopped" in result.stderr
    assert_nothing_launched(repo)


@pytest.mark.slow
def test_not_a_repository(tmp_path):
    result = moe_perf(tmp_path, "wandb.mode=disabled")
    assert result.returncode == 2
    assert "repo=." in result.stderr and "not inside a git repository" in result.stderr


@pytest.mark.slow
def test_check_job_accepts_every_default_and_refuses_each_violation(tmp_path):
    validate.check_job(composed(), tmp_path)
    for name, (overrides, words) in VIOLATIONS.items():
        if name in ("missing ref",):
            continue  # a sweep-level check
        with pytest.raises(validate.PrerequisiteError) as err:
            validate.check_job(composed(*overrides), tmp_path)
        assert words[0] in str(err.value), name


def test_refs_are_reported_together(repo):
    with pytest.raises(validate.PrerequisiteError) as err:
        validate.resolve_refs(repo, {"base": "nope", "feat": None})
    assert "refs.base=nope" in str(err.value) and "refs.feat is not set" in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["batch per dp >= 2pp", "micro batch", "micro-batches >= pp"])
def test_the_trainer_refuses_a_batch_with_the_runners_message(repo, name):
    """The runner (validate.py, through the real command) and the trainer (Config.validate on
    the resolved config) call the same mesh.py check: the same one-line message."""
    overrides, _ = VIOLATIONS[name]
    result = moe_perf(repo, *overrides, "wandb.mode=disabled")
    assert result.returncode == 2, result.stdout + result.stderr
    runner = next(line for line in result.stderr.splitlines() if "cannot run" in line)
    cfg = composed(*overrides)
    sections = ("model", "mesh", "dtype", "training", "data", "trainer")  # what the trainer reads
    resolved = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in sections}
    with pytest.raises(ValueError) as err:
        config_from_dict(resolved).validate()
    assert not isinstance(err.value, ConfigError)  # MeshError, from mesh.py
    assert runner.endswith(f"cannot run: {err.value}")


# Issue 13's bad inputs, each with the override its one-line message must name. Before: names
# wrote directories outside the sweep directory, arm.name=x crashed with a KeyError after
# creating a directory, mesh.pp=0 was a ZeroDivisionError from the tag, a sequence length of 0
# launched both arms.
BAD_INPUTS = {
    "model.name=../../../x": "model.name='../../../x' is not a safe directory name",
    "model.name=a/b": "model.name='a/b' is not a safe directory name",
    "model.name=..": "model.name='..' is not a safe directory name",
    "tag=../../x": "tag='../../x' is not a safe directory name",
    "tag=.hidden": "tag='.hidden' is not a safe directory name",
    "arm.name=x": "arm.name=x: expected one of base, feat; change arm.name",
    "arm.name=../feat": "arm.name=../feat: expected one of base, feat",
    "trainer.name=../x": "trainer.name='../x' is not a safe directory name",
    "launcher.name=a/b": "launcher.name='a/b' is not a safe directory name",
    "dtype.name=../x": "dtype.name=../x: expected one of fp32, bf16, fp8",
    "mesh.pp=0": "mesh.pp=0 must be >= 1; change mesh.pp",
    "mesh.cp=-1": "mesh.cp=-1 must be >= 1; change mesh.cp",
    "mesh.ep=0": "mesh.ep=0 must be >= 1; change mesh.ep",
    "mesh.nproc_per_node=0": "mesh.nproc_per_node=0 must be >= 1",
    "mesh.nnodes=0": "mesh.nnodes=0 must be >= 1",
    "training.sequence_length=0": "training.sequence_length=0 must be >= 1",
    "training.sequence_length=-8": "training.sequence_length=-8 must be >= 1",
    "training.global_batch=0": "training.global_batch=0 must be >= 1",
    "training.micro_batch=0": "training.micro_batch=0 must be >= 1",
    "training.max_steps=0": "training.max_steps=0 must be >= 2 (step 1 is dropped as warm-up)",
    "training.lr=nan": "training.lr=nan must be > 0",
    "timeout_s=0": "timeout_s=0.0 must be > 0; change timeout_s",
    "timeout_s=-5": "timeout_s=-5.0 must be > 0",
    "repeat=-1": "repeat=-1 must be >= 0",
    "model.num_layers=0": "model.num_layers=0 must be >= 1",
    "model.num_kv_heads=0": "model.num_kv_heads=0 must be >= 1",
    "model.top_k=9": "model.top_k=9 must be in 1..model.num_experts=8",
    "trainer.pp_virtual_stages=0": "trainer.pp_virtual_stages=0 must be >= 1",
    "trainer.sample_stacks_ms=-5": "trainer.sample_stacks_ms=-5.0 must be >= 0",
    "trainer.activation_checkpointing=some": "trainer.activation_checkpointing=some: expected",
    "launcher.kill_grace_s=-1": "launcher.kill_grace_s=-1.0 must be >= 0",
    "mesh.device_memory_gib=0": "mesh.device_memory_gib=0.0 must be > 0",
}


def assert_nothing_written(repo: Path) -> None:
    assert_nothing_launched(repo)
    assert sorted(p.name for p in repo.parent.iterdir()) == ["repo"]  # nothing beside the repo
    written = [p for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts]
    assert written == [repo / "README.md"]


# through the real command: the names that become paths, and the inputs that crashed before
THROUGH_THE_COMMAND = [
    "model.name=../../../x",
    "tag=../../x",
    "arm.name=x",
    "trainer.name=../x",
    "dtype.name=../x",
    "mesh.pp=0",
    "training.sequence_length=0",
    "timeout_s=0",
]


@pytest.mark.slow
@pytest.mark.parametrize("override", list(BAD_INPUTS))
def test_a_bad_input_is_refused_with_one_line(override):
    with pytest.raises(validate.PrerequisiteError) as err:
        validate.check_config(composed(override))
    assert BAD_INPUTS[override] in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("override", THROUGH_THE_COMMAND)
def test_a_bad_input_is_one_line_before_anything_is_written(repo, override):
    result = moe_perf(repo, override, "wandb.mode=disabled")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "Error" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "cannot run" in line]
    assert BAD_INPUTS[override] in line
    assert_nothing_written(repo)


@pytest.mark.slow
def test_a_bad_input_in_a_sweep_stops_it_before_any_arm(repo):
    result = moe_perf(repo, "-m", "arm=base,feat", "training.sequence_length=0,64")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "training.sequence_length=0 must be >= 1" in result.stderr
    assert "Traceback" not in result.stderr
    assert_nothing_launched(repo)


@pytest.mark.parametrize(
    "override", ["training.sequence_length=0", "mesh.pp=0", "training.max_steps=1"]
)
def test_the_trainer_refuses_a_value_out_of_range_with_the_runners_message(override):
    """The same bounds (the field's metadata in common/config.py) on both sides."""
    cfg = composed(override)
    runner = None
    try:
        validate.check_config(cfg)
    except validate.PrerequisiteError as err:
        runner = str(err)
    sections = ("model", "mesh", "dtype", "training", "data", "trainer")
    resolved = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in sections}
    with pytest.raises(ConfigError) as err:
        config_from_dict(resolved).validate()
    assert runner is not None and str(err.value) == runner
