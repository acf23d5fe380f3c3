"""trainer.early_cuda_context: the CUDA context made in a thread while the trainer imports
(trainer/early.py). On by default; on a machine without a GPU it starts nothing and the run
is the run without it; on a GPU the context's thread is recorded in startup.json and the steps'
losses are those of the run without it."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.trainer_run import run_trainer, write_config

from moe_perf.common.config import TrainerConfig
from moe_perf.trainer import early

SHAPES = ["training.max_steps=2"]


def test_on_by_default_since_a_gpu_measured_a_gain():
    assert TrainerConfig().early_cuda_context is True


def test_started_only_where_the_config_asks_for_it_on_a_gpu(tmp_path):
    config = str(write_config(tmp_path))
    assert early.start([config]) is None  # the default asks for it, but training.device=cpu
    assert early.start([config, "trainer.early_cuda_context=true"]) is None  # training.device=cpu
    assert early.start([str(tmp_path / "missing.yaml")]) is None  # main reports it
    assert early.start([]) is None
    on_gpu = [config, "trainer.early_cuda_context=true", "training.device=cuda"]
    assert early.wanted(on_gpu) is torch.cuda.is_available()
    assert (
        early.wanted([config, "trainer.early_cuda_context=false", "training.device=cuda"]) is False
    )


@pytest.mark.slow
def test_the_trainer_runs_the_same_with_the_switch_on_a_cpu(tmp_path):
    """The real entry point (`python -m moe_perf.trainer`), the switch on and off: the same
    losses; without a GPU no thread was started, so startup.json has nothing to say of it."""
    losses = {}
    for switch in ("false", "true"):
        (tmp_path / switch).mkdir()
        config = write_config(tmp_path / switch)
        proc, steps = run_trainer(["-m", "moe_perf.trainer", str(config), *SHAPES,
                                   f"trainer.early_cuda_context={switch}"])  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        losses[switch] = [s["loss"] for s in steps]
        startup = json.loads((config.parent / "startup.json").read_text())
        assert "early_cuda_context" not in startup
    assert len(losses["true"]) == 2 and losses["true"] == losses["false"]


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_context_is_made_in_its_thread_and_the_losses_are_unchanged(tmp_path):
    losses = {}
    for switch in ("false", "true"):
        (tmp_path / switch).mkdir()
        config = write_config(tmp_path / switch, training={"device": "cuda"})
        proc, steps = run_trainer(["-m", "moe_perf.trainer", str(config), *SHAPES,
                                   f"trainer.early_cuda_context={switch}"])  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        losses[switch] = [s["loss"] for s in steps]
        startup = json.loads((config.parent / "startup.json").read_text())
        if switch == "true":
            made = startup["early_cuda_context"]
            assert made["error"] is None and made["seconds"] > 0 and made["waited_s"] >= 0
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-4)
