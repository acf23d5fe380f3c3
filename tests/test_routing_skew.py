"""routing=balanced|skew|real: the skew plan's exact counts, the ids the trainer sends tokens to,
the tag, and the checks before launch. Across meshes: tests/test_routing_meshes.py."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers.compose import composed

from moe_perf.common.config import ConfigError, config_from_dict
from moe_perf.common.errors import PrerequisiteError
from moe_perf.common.mesh import MeshDims
from moe_perf.common.routing import RoutingError, placement, skew_plan, tag_suffix, zipf_exponent
from moe_perf.frameworks.command import CommandTrainer
from moe_perf.runner.preflight import check_config
from moe_perf.runner.schema import mesh_dims
from moe_perf.trainer.moe import MoE, set_expert_assignment
from moe_perf.trainer.routing import BalancedSlots, SkewedSlots, forced_expert_ids

# (experts, top_k, tokens of a rank's micro-batch, ep): the shipped shapes' proportions
SHAPES = [(8, 2, 64, 1), (8, 2, 32, 4), (128, 8, 256, 8), (64, 6, 128, 4), (32, 4, 48, 2)]
REQUESTS = [  # (imbalance, shape, hot_experts, hot_ranks as a fraction of ep: 1 or all)
    (1.0, "hot", 1, "one"),
    (1.5, "hot", 1, "one"),
    (2.0, "hot", 3, "all"),
    (4.0, "hot", 1, "all"),
    (1.5, "zipf", 1, "one"),
    (3.0, "zipf", 1, "all"),
]


def plan_of(E, K, T, ep, imbalance, shape, hot_experts, ranks):
    return skew_plan(num_experts=E, top_k=K, tokens=T, ep=ep, imbalance=imbalance, shape=shape,
                     hot_experts=hot_experts, hot_ranks=1 if ranks == "one" else ep)  # fmt: skip


# ---- the plan --------------------------------------------------------------------------------


@pytest.mark.parametrize("request_", REQUESTS)
@pytest.mark.parametrize("E,K,T,ep", SHAPES)
def test_the_plan_gives_every_token_k_distinct_experts_and_every_expert_its_count(
    E, K, T, ep, request_
):
    plan = plan_of(E, K, T, ep, *request_)
    assert sum(plan.counts) == T * K and max(plan.counts) <= T
    assert plan.expert_imbalance == pytest.approx(request_[0], rel=0.01)
    table = torch.tensor(plan.table())
    assert table.shape == (T, K)
    assert (table.sort(1).values.diff(dim=1) > 0).all()  # K distinct experts per token
    assert torch.bincount(table.reshape(-1), minlength=E).tolist() == list(plan.counts)


@pytest.mark.parametrize("E,K,T,ep", SHAPES)
def test_the_trainer_sends_by_the_plan_from_any_offset(E, K, T, ep):
    """Any T consecutive global tokens hold exactly the planned counts: a micro-batch of T tokens
    on any rank, whatever its offset."""
    plan = plan_of(E, K, T, ep, 2.0, "hot", 1, "one")
    slots = SkewedSlots(plan)
    assert slots.expert_ids(torch.tensor(0), T).tolist() == plan.table()
    for offset in (T, 3 * T, 7, T + 5):
        ids = slots.expert_ids(torch.tensor(offset), T)
        assert torch.bincount(ids.reshape(-1), minlength=E).tolist() == list(plan.counts)
        assert torch.equal(ids, torch.tensor(plan.table()).roll(-offset, 0))


def test_hot_set_shape_and_its_placement_on_ep_ranks():
    E, K, T, ep = 16, 2, 64, 4  # 4 experts per EP rank; mean 8 slots per expert
    one = skew_plan(num_experts=E, top_k=K, tokens=T, ep=ep, imbalance=3.0, hot_experts=2)
    assert sorted(one.counts, reverse=True)[:2] == [24, 24]
    assert one.counts[0] == one.counts[1] == 24  # both hot experts on EP rank 0
    assert one.rank_loads()[0] == max(one.rank_loads())
    spread = skew_plan(num_experts=E, top_k=K, tokens=T, ep=ep, imbalance=3.0, hot_experts=2,
                       hot_ranks=ep)  # fmt: skip
    assert spread.counts[0] == spread.counts[4] == 24  # experts 0 and 4: ranks 0 and 1
    assert spread.rank_imbalance < one.rank_imbalance
    assert max(spread.rank_loads()) - min(spread.rank_loads()) <= 24 - 6  # one hot expert apart


def test_placement_fills_the_hot_ranks_first_then_the_others():
    assert placement(8, 4, 1) == [0, 1, 2, 4, 6, 3, 5, 7]  # the 2 busiest on rank 0
    assert placement(8, 4, 2) == [0, 2, 1, 3, 4, 6, 5, 7]  # the 4 busiest over ranks 0, 1
    assert placement(8, 4, 4) == [0, 2, 4, 6, 1, 3, 5, 7]  # the 4 busiest on 4 ranks
    for ep, hot in itertools.product((1, 2, 4, 8), (1, 2)):
        if hot <= ep:
            assert sorted(placement(8, ep, hot)) == list(range(8))


def test_zipf_counts_fall_with_rank_and_its_exponent_is_solved():
    assert zipf_exponent(8, 1.0) == pytest.approx(0.0, abs=1e-9)
    s = zipf_exponent(64, 2.5)
    assert 64 / sum((j + 1) ** -s for j in range(64)) == pytest.approx(2.5)
    plan = skew_plan(num_experts=64, top_k=6, tokens=512, ep=1, imbalance=2.5, shape="zipf")
    assert list(plan.counts) == sorted(plan.counts, reverse=True)  # ep=1: ids in profile order
    assert plan.counts[0] > plan.counts[1] > plan.counts[-1] > 0


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(imbalance=4.5), r"routing.imbalance=4.5 must be in 1..E/K = 8/2 = 4"),
        (dict(imbalance=2.0, hot_ranks=3), r"routing.hot_ranks=3 must be in 1..mesh.ep=2"),
        (dict(imbalance=2.0, hot_experts=5), r"hot_experts=5 x routing.imbalance=2 > "),
        (dict(imbalance=1.3, tokens=16), r"cannot be planned within 1% .*nearest: 1.25.*micro_b"),
        (dict(imbalance=2.0, shape="flat"), r"routing.shape=flat: expected one of hot, zipf"),
    ],
)
def test_a_request_no_plan_meets_names_the_override(kwargs, message):
    args = {"num_experts": 8, "top_k": 2, "tokens": 64, "ep": 2, **kwargs}
    with pytest.raises(RoutingError, match=message):
        skew_plan(**args)


# ---- balanced stays what it was --------------------------------------------------------------


@pytest.mark.parametrize("E,K,ep", [(8, 2, 1), (8, 2, 2), (128, 8, 8), (64, 6, 4), (16, 3, 4)])
def test_balanced_is_the_documented_round_robin_bit_for_bit(E, K, ep):
    """expert(s) = (s % ep) * (E/ep) + (s // ep) % (E/ep) over the global slot s = g*K + k
    (docs/design.md, "Forced balance"), for the ids the MoE block dispatches."""
    moe = MoE(16, E, K, 16, force_balance=True, balance_ep=ep)
    moe.init_weights(0.02, 0.02)
    for offset in (0, 40, 1234):
        moe.global_token_offset = offset
        _, _, idx_TK, _ = moe.route(torch.randn(12, 16))
        s = [[(offset + t) * K + k for k in range(K)] for t in range(12)]
        formula = [[(x % ep) * (E // ep) + (x // ep) % (E // ep) for x in row] for row in s]
        assert idx_TK.tolist() == formula
        assert torch.equal(idx_TK, forced_expert_ids(offset, 12, K, E, ep))


def test_the_trainer_installs_one_assignment_per_mode():
    from moe_perf.trainer.routing import expert_assignment

    base = composed("mesh=ep2")
    sections = {k: dict(base[k]) for k in ("model", "mesh", "training", "dtype")}
    for mode, kind in (("balanced", BalancedSlots), ("skew", SkewedSlots), ("real", type(None))):
        cfg = config_from_dict({**sections, "routing": {"mode": mode}})
        assert type(expert_assignment(cfg, cfg.mesh_dims, "cpu")) is kind
    balanced = expert_assignment(config_from_dict(sections), MeshDims(world=2, ep=2), "cpu")
    assert (balanced.num_experts, balanced.top_k, balanced.ep) == (8, 2, 2)


def test_real_routing_dispatches_the_routers_own_top_k():
    torch.manual_seed(0)
    moe = MoE(16, 8, 2, 16, force_balance=True)
    set_expert_assignment(moe, None)
    moe.init_weights(0.02, 0.02)
    x = torch.randn(10, 16)
    scores, real, idx, _ = moe.route(x)
    assert torch.equal(idx, real) and torch.equal(real, scores.topk(2, dim=-1).indices)


# ---- the tag and the config ------------------------------------------------------------------

MESHES = ("single", "ep2", "ep4", "pp2_ep2", "cp2_ep2", "ep8", "pp2_ep4", "cp2_ep4", "pp2_ep8")


@pytest.mark.parametrize("mesh", MESHES)
def test_balanced_tag_is_unchanged_and_others_are_named(mesh):
    cfg = composed(f"mesh={mesh}")
    dims, seq = mesh_dims(cfg.mesh), cfg.training.sequence_length
    assert cfg.routing.mode == "balanced"
    assert cfg.tag == dims.tag(seq, "fp32")
    assert cfg.tag == f"pp{dims.pp}-dp{dims.dp}-cp{dims.cp}-ep{dims.ep}-seq{seq}-fp32"
    assert composed(f"mesh={mesh}", "routing=skew").tag == f"{cfg.tag}-skew2.0"
    assert composed(f"mesh={mesh}", "routing=real").tag == f"{cfg.tag}-real"


@pytest.mark.slow
def test_every_routing_knob_that_changes_the_run_changes_the_tag():
    """Arms of a sweep over any routing key must not share an arm directory or a comparison."""
    tags = [
        composed("mesh=ep4", "routing=skew", *extra).tag
        for extra in ([], ["routing.imbalance=1.5"], ["routing.imbalance=1.25"],
                      ["routing.shape=zipf"], ["routing.hot_experts=2"],
                      ["routing.hot_ranks=4"], ["routing.shape=zipf", "routing.hot_ranks=2"])
    ]  # fmt: skip
    assert tags == [f"pp1-dp4-cp1-ep4-seq512-fp32{s}" for s in (
        "-skew2.0", "-skew1.5", "-skew1.25", "-skew2.0-zipf", "-skew2.0-hot2",
        "-skew2.0-ranks4", "-skew2.0-zipf-ranks2")]  # fmt: skip
    assert tag_suffix("balanced", 3.0, "zipf", 2, 2) == ""


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["routing.imbalance=3"], "routing.imbalance=3.0 is used only by routing=skew (this run "
                                  "is routing=balanced); add routing=skew"),
        (["routing=real", "routing.hot_ranks=2"], "routing.hot_ranks=2 is used only by "
                                                  "routing=skew (this run is routing=real)"),
        (["routing=skew", "routing.imbalance=5"], "routing.imbalance=5 must be in 1..E/K"),
        (["routing=skew", "routing.hot_ranks=2"], "routing.hot_ranks=2 must be in 1..mesh.ep=1"),
        (["routing=skew", "routing.imbalance=0.5"], "routing.imbalance=0.5 must be >= 1"),
        (["routing.mode=uneven"], "routing.mode=uneven: expected one of balanced, skew, real"),
    ],
)  # fmt: skip
def test_the_preflight_refuses_a_routing_it_cannot_run(overrides, message):
    with pytest.raises(PrerequisiteError) as err:
        check_config(composed(*overrides))
    assert message in str(err.value)


def test_the_trainer_refuses_the_old_benchmark_switch_and_checks_the_plan():
    sections = {k: dict(composed()[k]) for k in ("model", "mesh", "training")}
    old = {**sections, "training": {**sections["training"], "benchmark": False}}
    with pytest.raises(ConfigError, match="training.benchmark was replaced by the routing group"):
        config_from_dict(old)
    cfg = config_from_dict({**sections, "routing": {"mode": "skew", "imbalance": 9.0}})
    with pytest.raises(ConfigError, match="routing.imbalance=9 must be in 1..E/K"):
        cfg.validate()


def test_command_trainer_gets_the_routing_placeholders(tmp_path):
    cfg = composed("trainer=command", "routing=skew", "routing.imbalance=1.5",
                   "trainer.command=[train.py,'--routing={routing.mode}',"
                   "'--skew={routing.imbalance}','--shape={routing.shape}',"
                   "'--hot-ranks={routing.hot_ranks}']")  # fmt: skip
    check_config(cfg)
    argv = CommandTrainer().launch(cfg, tmp_path, tmp_path / "config.yaml", tmp_path).argv
    assert argv == ["train.py", "--routing=skew", "--skew=1.5", "--shape=hot", "--hot-ranks=1"]
