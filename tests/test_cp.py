"""Context parallel: zig-zag sharding round trips; CP attention equals full causal attention.

The attention checks run in float64: CP attention computes exactly the same softmax rows as the
full-sequence reference (the gathered keys are only in another order), so outputs and Q/K/V
gradients agree to rtol 1e-10, atol 1e-12.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.distributed import run_distributed
from helpers.mesh_equivalence import check_meshes

from moe_perf.trainer.cp import (
    cp_attention,
    shard_batch,
    shard_sequence,
    unshard_sequence,
    zigzag_positions,
)

RTOL, ATOL = 1e-10, 1e-12


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_round_trip(cp):
    x_BTD = torch.randn(2, 8 * cp, 3)
    shards = [shard_sequence(x_BTD, cp, r) for r in range(cp)]
    assert all(s.shape == (2, 8, 3) for s in shards)
    assert torch.equal(unshard_sequence(shards), x_BTD)
    positions = torch.cat([zigzag_positions(8 * cp, cp, r) for r in range(cp)])
    assert sorted(positions.tolist()) == list(range(8 * cp))


def test_zigzag_layout_and_balance():
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    tokens = torch.arange(16).reshape(2, 8)
    t, labels, positions_BT = shard_batch(tokens, tokens + 1, 2, 1)
    assert t.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert torch.equal(labels, t + 1)
    assert positions_BT.tolist() == [[2, 3, 4, 5]] * 2
    # Causal work per rank (query-key pairs) is the same on every rank.
    seq, cp = 64, 4
    work = [int((zigzag_positions(seq, cp, r) + 1).sum()) for r in range(cp)]
    assert len(set(work)) == 1


def test_zigzag_rejects_indivisible_sequence():
    with pytest.raises(ValueError, match="2\\*cp"):
        zigzag_positions(10, 3, 0)


def _reference(q, k, v, window):
    S = q.shape[2]
    pos = torch.arange(S)
    delta = pos[:, None] - pos[None, :]
    mask = delta >= 0
    if window:
        mask &= delta < window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _check_attention(rank: int, world_size: int) -> None:
    torch.manual_seed(0)  # same full inputs on every rank
    B, H, G, S, D, E = 2, 4, 2, 16, 8, 6
    q = torch.randn(B, H, S, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, G, S, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, G, S, E, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(B, H, S, E, dtype=torch.float64)
    groups = {
        2: [dist.new_group([0, 1]), dist.new_group([2, 3])],
        4: [dist.new_group([0, 1, 2, 3])],
    }
    for cp, group_list in groups.items():
        group = group_list[rank // cp]
        cp_rank = dist.get_rank(group)
        for window, flash_friendly in ((0, False), (0, True), (5, False)):
            ref = _reference(q, k, v, window)
            ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)

            ql, kl, vl = (
                shard_sequence(t.detach(), cp, cp_rank, dim=2).requires_grad_() for t in (q, k, v)
            )
            out = cp_attention(
                ql,
                kl,
                vl,
                zigzag_positions(S, cp, cp_rank),
                group,
                window=window,
                flash_friendly=flash_friendly,
            )
            grads = torch.autograd.grad(out, (ql, kl, vl), shard_sequence(grad_out, cp, cp_rank, 2))
            case = f"cp={cp} window={window} flash_friendly={flash_friendly}"
            torch.testing.assert_close(
                out, shard_sequence(ref, cp, cp_rank, 2), rtol=RTOL, atol=ATOL, msg=case
            )
            for name, g, rg in zip("qkv", grads, ref_grads, strict=True):
                torch.testing.assert_close(
                    g,
                    shard_sequence(rg, cp, cp_rank, 2),
                    rtol=RTOL,
                    atol=ATOL,
                    msg=lambda m, n=name, c=case: f"d{n} {c}: {m}",
                )


@pytest.mark.slow
def test_cp_attention_matches_full_causal_attention():
    """cp=2 (two groups of two) and cp=4 in one 4-process run; GQA, a window, both paths."""
    run_distributed(_check_attention, 4)


# ---------------------------------------------------------------------------------------------
# The trainer's own path (parallelize + train step) on cp meshes: tests/helpers/mesh_equivalence.py
# (router top-k routing: forced balance numbers a rank's zig-zag tokens as one block).


@pytest.mark.slow
def test_trainer_cp2_matches_single_process():
    """cp2 (dp1): global-batch loss; sequence loss (counts all-reduced over the cp group)."""
    run_distributed(
        check_meshes,
        2,
        [
            dict(cp=2, micro_batch=2, benchmark=False),
            dict(cp=2, micro_batch=1, benchmark=False, load_balance="sequence"),
        ],
    )


@pytest.mark.slow
def test_trainer_cp2_ep2_matches_single_process():
    """cp2 x ep2 (dp2, the cp2_ep2 preset's mesh), global-batch loss."""
    run_distributed(check_meshes, 4, [dict(cp=2, ep=2, micro_batch=1, benchmark=False)])
