"""The tiny model under expert and data parallel gives the loss and gradients of one process.

For each mesh (dp, ep) on `dp` gloo processes: every rank builds the tiny model on the meta
device as the trainer does, then `init_parallel` + `parallelize` (EP slices experts and swaps
dispatchers, the rank's part is materialized from the seed, FSDP2 shards), and a
single-process reference from the same seed. Both train 3 steps on the same global batches
(train.py's data layout: micro-batch m of dp rank r is global rows (m*dp + r)*micro_batch...),
with gradient accumulation over micro-batches and plain SGD at a fixed lr. The reference runs
micro-step m on the union of the ranks' m-th micro-batches, which is what the global-batch
balance loss sees under data parallel. Checked:
  * the initial parameters, gathered (FSDP shards, then EP shards): exactly the reference's;
  * step-1 gradients: every parameter, gathered (FSDP shards, then EP shards), against the
    reference's gradient;
  * the global gradient norm (parallelize.clip_grad_norm_ over FSDP and EP shards) against
    torch's on the reference, with clipping active;
  * losses of steps 1-3 (after two clipped SGD updates the models must still agree) and the
    final parameters.
Tolerance, fp32 throughout: rtol 1e-5, atol 1e-6 (the parallel run sums the same terms in a
different order: all-reduces, per-rank batches, expert-sorted rows).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from moe_perf.common.config import config_from_dict
from moe_perf.common.mesh import MeshDims
from moe_perf.trainer.model import build_model, cross_entropy
from moe_perf.trainer.moe import set_aux_loss_grad_scale, set_token_offset
from moe_perf.trainer.parallelize import clip_grad_norm_, init_parallel, parallelize
from tests.distributed_util import full_tensor, run_distributed

RTOL, ATOL = 1e-5, 1e-6
SEQ, GLOBAL_BATCH, STEPS, LR = 16, 8, 3, 0.5
MAX_GRAD_NORM = 0.5  # below the tiny model's gradient norm: clipping is active
TINY = Path(__file__).resolve().parents[1] / "conf" / "model" / "tiny.yaml"


def tiny_config(dp: int, ep: int, micro_batch: int, benchmark: bool, load_balance: str):
    model = yaml.safe_load(TINY.read_text())
    model["load_balance"] = load_balance
    model["load_balance_coeff"] = 0.01  # large enough that a wrong balance gradient shows
    cfg = config_from_dict(
        {
            "model": model,
            "mesh": {"nproc_per_node": dp, "ep": ep},
            "dtype": {"name": "fp32"},
            "training": {
                "sequence_length": SEQ,
                "global_batch": GLOBAL_BATCH,
                "micro_batch": micro_batch,
                "seed": 0,
            },
            "routing": {"mode": "balanced" if benchmark else "real"},
        }
    )
    cfg.validate()
    return cfg


def global_rows(step: int, vocab: int) -> torch.Tensor:
    """The step's global batch [GLOBAL_BATCH, SEQ+1], identical on every rank."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=gen)


def local_microbatches(rows: torch.Tensor, micro_batch: int, dp: int, dp_rank: int):
    """[(inputs_BS, labels_BS)] of dp rank `dp_rank`, m-major as in data.py."""
    out = []
    for m in range(rows.shape[0] // (dp * micro_batch)):
        start = (m * dp + dp_rank) * micro_batch
        chunk = rows[start : start + micro_batch]
        out.append((chunk[:, :-1], chunk[:, 1:]))
    return out


def full_grad(name: str, param, par) -> torch.Tensor:
    return full_tensor(name, param.grad, par)


def full_param(name: str, param, par) -> torch.Tensor:
    return full_tensor(name, param.detach(), par)


def train_step(model, microbatches, offsets, tokens_per_micro, group=None) -> torch.Tensor:
    """Forward/backward over the micro-batches; returns the step's mean cross-entropy."""
    n = len(microbatches)
    set_aux_loss_grad_scale(model, 1.0 / n)
    total = torch.zeros(())
    for (inputs, labels), offset in zip(microbatches, offsets, strict=True):
        set_token_offset(model, offset)
        loss = cross_entropy(model(inputs), labels) / n
        loss.backward()
        total += loss.detach()
    if group is not None:
        dist.all_reduce(total, group=group)
        total /= dist.get_world_size(group)
    return total


def _check_mesh(rank, world, ep, micro_batch, benchmark, load_balance):
    dp = world
    cfg = tiny_config(dp, ep, micro_batch, benchmark, load_balance)
    dims = MeshDims(world=world, ep=ep)
    reference = build_model(cfg.model, seed=0, force_balance=benchmark, balance_ep=ep)
    model = build_model(cfg.model, seed=0, force_balance=benchmark, balance_ep=ep, device="meta")
    par = init_parallel(dims, torch.device("cpu"))
    model = parallelize(model, par, cfg)
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(full_param(name, p, par), ref_params[name]), name

    tokens_per_micro = micro_batch * SEQ
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)

    for step in range(1, STEPS + 1):
        rows = global_rows(step, cfg.model.vocab_size)
        mine = local_microbatches(rows, micro_batch, dp, rank)
        offsets = [dims.token_offset(m, rank, micro_batch, SEQ) for m in range(len(mine))]
        loss = train_step(model, mine, offsets, tokens_per_micro, par.group("dp_cp"))

        # Reference micro-step m: the union of every rank's m-th micro-batch, in rank order.
        per_rank = [local_microbatches(rows, micro_batch, dp, r) for r in range(dp)]
        union = [
            tuple(torch.cat([per_rank[r][m][i] for r in range(dp)]) for i in (0, 1))
            for m in range(len(mine))
        ]
        ref_offsets = [m * dp * tokens_per_micro for m in range(len(union))]
        ref_loss = train_step(reference, union, ref_offsets, dp * tokens_per_micro)

        torch.testing.assert_close(
            loss, ref_loss, rtol=RTOL, atol=ATOL, msg=lambda m, s=step: f"loss of step {s}: {m}"
        )
        if step == 1:
            for name, p in model.named_parameters():
                torch.testing.assert_close(
                    full_grad(name, p, par),
                    ref_params[name].grad,
                    rtol=RTOL,
                    atol=ATOL,
                    msg=lambda m, n=name: f"step-1 gradient of {n}: {m}",
                )
        norm = clip_grad_norm_(list(model.parameters()), MAX_GRAD_NORM, par)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_GRAD_NORM)
        torch.testing.assert_close(
            norm,
            ref_norm,
            rtol=RTOL,
            atol=ATOL,
            msg=lambda m, s=step: f"gradient norm of step {s}: {m}",
        )
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()

    for name, p in model.named_parameters():
        torch.testing.assert_close(
            full_param(name, p, par),
            ref_params[name].detach(),
            rtol=RTOL,
            atol=ATOL,
            msg=lambda m, n=name: f"parameter {n} after {STEPS} steps: {m}",
        )


def _check_meshes(rank, world, cases):
    for case in cases:
        _check_mesh(rank, world, **case)


FORCED = {"benchmark": True, "load_balance": "global-batch"}


@pytest.mark.parametrize(
    "world,cases",
    [
        # One process under torchrun (mesh=single): FSDP over one rank.
        (1, [dict(ep=1, micro_batch=2, **FORCED)]),
        (
            2,
            [
                dict(ep=1, micro_batch=2, **FORCED),
                dict(ep=2, micro_batch=2, **FORCED),
                # Real routing (top-k of the router) and the sequence balance loss.
                dict(ep=2, micro_batch=4, benchmark=False, load_balance="sequence"),
            ],
        ),
        (
            4,
            [
                dict(ep=2, micro_batch=1, **FORCED),
                dict(ep=4, micro_batch=1, **FORCED),
                dict(ep=4, micro_batch=2, benchmark=False, load_balance="global-batch"),
            ],
        ),
    ],
    ids=["dp1-ep1", "dp2-ep1,2", "dp4-ep2,4"],
)
def test_tiny_model_matches_single_process(world, cases):
    run_distributed(_check_meshes, world, cases)
