"""Every routing on every mesh preset that runs on CPU (gloo): the trainer's own build and step,
then the step's gathered counts (train.step_counts, what the step line's expert_imbalance and
rank_imbalance come from) against the plan, exactly.

skew: every MoE layer's experts get the plan's counts times the rank micro-batches of a step;
every device processes what its EP rank's experts are planned to receive. balanced: every
expert and every device the same count. real: the router's own top-k, every slot counted once.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import yaml
from helpers.distributed import run_distributed

from moe_perf.common.config import config_from_dict, skew_plan_of
from moe_perf.trainer import train

ROOT = Path(__file__).resolve().parents[1]
SEQ, GLOBAL_BATCH, MICRO_BATCH = 32, 8, 2
CASES = [
    {"mode": "skew", "imbalance": 2.0},
    {"mode": "skew", "imbalance": 1.5, "shape": "zipf", "hot_ranks": "ep"},
    {"mode": "balanced"},
    {"mode": "real"},
]


def mesh_preset(name: str) -> dict:
    return yaml.safe_load((ROOT / "conf" / "mesh" / f"{name}.yaml").read_text())


def trainer_config(mesh: dict, routing: dict):
    model = yaml.safe_load((ROOT / "conf" / "model" / "tiny.yaml").read_text())
    model.pop("defaults")
    if routing.get("hot_ranks") == "ep":
        routing = {**routing, "hot_ranks": mesh["ep"]}
    return config_from_dict({
        "model": {**model, "num_layers": 3},
        "mesh": mesh,
        "dtype": {"name": "fp32"},
        "training": {"sequence_length": SEQ, "global_batch": GLOBAL_BATCH,
                     "micro_batch": MICRO_BATCH, "max_steps": 2, "seed": 3, "device": "cpu"},
        "routing": routing,
    })  # fmt: skip


def expected_skew(cfg) -> tuple[list[int], list[int]]:
    """(slots per expert, slots per dp*cp device) of one MoE layer in one step."""
    dims, plan = cfg.mesh_dims, skew_plan_of(cfg.routing, cfg.model, cfg.mesh_dims, cfg.training)
    per_step = GLOBAL_BATCH * SEQ // plan.tokens  # rank micro-batches of a step, per stage
    n_micro = dims.microbatches(GLOBAL_BATCH, MICRO_BATCH)
    loads = plan.rank_loads()
    devices = [n_micro * dims.ep * loads[d % dims.ep] for d in range(dims.dp_cp)]
    return [per_step * c for c in plan.counts], devices


def check_step(tr, cfg) -> None:
    E, K, dims = cfg.model.num_experts, cfg.model.top_k, cfg.mesh_dims
    loss, step_time = train.train_step(tr, train.local_batch(tr, 1))
    counts = train.step_counts(tr)
    experts, devices = counts.expert_counts(), counts.rank_loads()
    assert experts.shape == (cfg.model.num_layers, E)  # every layer, across pipeline stages
    slots = GLOBAL_BATCH * SEQ * K
    assert experts.sum(1).tolist() == [slots] * cfg.model.num_layers
    assert devices.sum(1).tolist() == [slots] * cfg.model.num_layers
    metrics = train.step_metrics(tr, loss, step_time)
    mode = cfg.routing.mode
    if mode == "skew":
        want_experts, want_devices = expected_skew(cfg)
        plan = skew_plan_of(cfg.routing, cfg.model, dims, cfg.training)
        for layer in range(cfg.model.num_layers):
            assert experts[layer].tolist() == want_experts
            assert devices[layer].tolist() == want_devices
        assert metrics["expert_imbalance"] == pytest.approx(plan.expert_imbalance, rel=1e-12)
        assert metrics["expert_imbalance"] == pytest.approx(cfg.routing.imbalance, rel=0.01)
        assert metrics["rank_imbalance"] == pytest.approx(plan.rank_imbalance, rel=1e-12)
    elif mode == "balanced":
        assert (experts == slots // E).all() and (devices == slots // dims.dp_cp).all()
        assert metrics["expert_imbalance"] == metrics["rank_imbalance"] == 1.0
    else:
        assert metrics["expert_imbalance"] >= 1.0 and metrics["rank_imbalance"] >= 1.0


def _check_mesh(rank, world, mesh: dict) -> None:
    torch.manual_seed(0)
    for routing in CASES:
        cfg = trainer_config(mesh, routing)
        cfg.validate()
        check_step(train.build(cfg, io.StringIO()), cfg)


def check_mesh(name: str) -> None:
    mesh = mesh_preset(name)
    world = mesh["nnodes"] * mesh["nproc_per_node"]
    if world == 1:
        _check_mesh(0, 1, mesh)
    else:
        run_distributed(_check_mesh, world, mesh)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["single", "ep2", "ep4", "pp2_ep2", "cp2_ep2"])
def test_every_routing_on_every_cpu_mesh(mesh):
    check_mesh(mesh)
