"""trainer.gc_freeze (on by default): the trainer moves the objects of its imports out of the
garbage collector's reach at `main` and gives them back when its run ends, says in startup.json
how many it froze, and trains the same with it off. startup.json's minor page faults, beside
the marks, count up through the start-up."""

from __future__ import annotations

import gc
import io
import json

import pytest
from helpers.trainer_run import write_config

from moe_perf.common import contract
from moe_perf.common.config import TrainerConfig, load_config
from moe_perf.trainer import train

SHAPES = ["training.global_batch=4", "training.micro_batch=2", "training.max_steps=2"]


def run(tmp_path, switch: bool) -> tuple[dict, list[float]]:
    """One in-process run: its startup.json and its steps' losses."""
    cfg = load_config(str(write_config(tmp_path)), [*SHAPES, f"trainer.gc_freeze={switch}"])
    out = io.StringIO()
    train.run(cfg, out=out, startup_path=tmp_path / "startup.json")
    steps = [contract.parse_step(line) for line in out.getvalue().splitlines()]
    losses = [step["loss"] for step in steps if step]
    return json.loads((tmp_path / "startup.json").read_text()), losses


def test_on_by_default():
    assert TrainerConfig().gc_freeze is True


@pytest.mark.parametrize("switch", [True, False])
def test_the_run_freezes_its_imports_and_gives_them_back(tmp_path, switch):
    before = gc.get_freeze_count()
    startup, _ = run(tmp_path, switch)
    assert gc.get_freeze_count() == before  # the process's collector as it was
    if switch:
        assert startup["gc_frozen_objects"] > 100_000  # torch's modules, functions, classes
    else:
        assert "gc_frozen_objects" not in startup


def test_losses_are_the_same_either_way(tmp_path):
    losses = {}
    for switch in (True, False):
        (tmp_path / str(switch)).mkdir()
        _, losses[switch] = run(tmp_path / str(switch), switch)
    assert len(losses[True]) == 2 and losses[True] == losses[False]


def test_minor_page_faults_count_up_through_the_marks(tmp_path):
    startup, _ = run(tmp_path, True)
    marks, faults = startup["marks_s"], startup["minor_faults"]
    assert list(faults) == list(marks)  # one count per mark, in the marks' order
    counts = list(faults.values())
    assert all(isinstance(c, int) for c in counts)
    assert counts == sorted(counts) and counts[-1] > counts[0] > 0
