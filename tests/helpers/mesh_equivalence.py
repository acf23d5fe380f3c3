"""The tiny model on a pp/cp/ep mesh, through the trainer's own code, against one process.

`check_mesh(rank, world, pp=, cp=, ep=, ...)` runs on every rank of a gloo group (with
helpers.distributed.run_distributed): each rank builds the tiny model on the meta device as
the trainer does, then `init_parallel` + `parallelize` (pipeline split, EP, materialization
from the seed, CP, FSDP2), and a single-process reference from the same seed; every parameter
this rank holds must equal the reference's exactly (its slice of it). Both train two steps with
plain SGD through train.py's step (`train.forward_backward`,
or `pp.forward_backward` + `pp.step_metrics` under PP) on train.py's data layout (micro-batch m
of dp rank r is global rows (m*dp + r)*micro_batch..., zig-zag sharded over cp). This is the
one harness for "a mesh trains as one process does": it drives the trainer's own code, never
a re-implementation of its step.

The reference runs micro-step m on the union of the dp ranks' m-th micro-batches (full
sequences), which is what the global-batch balance loss sees under data x context parallel.
Checked: every step's mean loss, every step-1 gradient this rank holds (FSDP shards gathered,
then the EP group's experts), the global gradient norm (pp and dp_cp reductions; with
`max_grad_norm` > 0 clipping is active, so later steps also check the clipped update) and every
parameter after the last step.

Tolerance, fp32: rtol 1e-5, atol 1e-6 (same terms, other summation orders: all-reduces,
per-rank batches, expert-sorted rows, masked instead of causal-kernel attention under CP).
Forced balance numbers slots by each rank's token block (rank-major over dp x cp), so under CP
it routes a token differently from one process by design: CP cases use the router's top-k.
"""

from __future__ import annotations

import re
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from helpers.distributed import full_tensor
from moe_perf.common.config import config_from_dict
from moe_perf.common.mesh import MeshDims
from moe_perf.trainer import pp
from moe_perf.trainer.cp import shard_batch
from moe_perf.trainer.model import build_model, cross_entropy
from moe_perf.trainer.moe import set_aux_loss_grad_scale, set_token_offset
from moe_perf.trainer.parallelize import clip_grad_norm_, init_parallel
from moe_perf.trainer.train import distribute, forward_backward

RTOL, ATOL = 1e-5, 1e-6
SEQ, GLOBAL_BATCH, STEPS, LR = 16, 8, 2, 0.5
TINY = Path(__file__).resolve().parents[2] / "conf" / "model" / "tiny.yaml"


def make_config(world, pp_, cp, ep, micro_batch, benchmark, load_balance, schedule, ac, experts):
    model = yaml.safe_load(TINY.read_text())
    model.update(load_balance=load_balance, load_balance_coeff=0.01)
    model["num_experts"] = experts or model["num_experts"]
    cfg = config_from_dict(
        {
            "model": model,
            "mesh": {"nproc_per_node": world, "pp": pp_, "cp": cp, "ep": ep},
            "dtype": {"name": "fp32"},
            "training": {
                "sequence_length": SEQ,
                "global_batch": GLOBAL_BATCH,
                "micro_batch": micro_batch,
                "seed": 0,
            },
            "routing": {"mode": "balanced" if benchmark else "real"},
            "trainer": {"pp_schedule": schedule, "activation_checkpointing": ac},
        }
    )
    cfg.validate()
    return cfg


def step_rows(step: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=gen)


def dp_microbatches(rows, micro_batch, dp, dp_rank):
    out = []
    for m in range(rows.shape[0] // (dp * micro_batch)):
        chunk = rows[(m * dp + dp_rank) * micro_batch :][:micro_batch]
        out.append((chunk[:, :-1], chunk[:, 1:]))
    return out


def full_grad(name: str, param, par) -> torch.Tensor:
    return full_tensor(name, param.grad, par)


def full_param(name: str, param, par) -> torch.Tensor:
    return full_tensor(name, param.detach(), par)


def reference_name(name: str, pipelined: bool) -> str:
    """The reference's name of a parameter of the parallelized model (stage index and
    checkpoint wrapper removed)."""
    name = name.replace("._checkpoint_wrapped_module", "")
    return re.sub(r"^\d+\.", "", name) if pipelined else name


def reference_step(reference, rows, micro_batch, dp):
    per_rank = [dp_microbatches(rows, micro_batch, dp, r) for r in range(dp)]
    n = len(per_rank[0])
    set_aux_loss_grad_scale(reference, 1.0 / n)
    total = 0.0
    for m in range(n):
        inputs = torch.cat([per_rank[r][m][0] for r in range(dp)])
        labels = torch.cat([per_rank[r][m][1] for r in range(dp)])
        set_token_offset(reference, m * dp * micro_batch * SEQ)
        loss = cross_entropy(reference(inputs), labels) / n
        loss.backward()
        total += float(loss.detach())
    return total


def check_mesh(
    rank,
    world,
    *,
    pp_=1,
    cp=1,
    ep=1,
    micro_batch=1,
    benchmark=True,
    load_balance="global-batch",
    schedule="1F1B",
    ac="none",
    experts=None,
    steps=STEPS,
    max_grad_norm=0.0,
):
    cfg = make_config(
        world, pp_, cp, ep, micro_batch, benchmark, load_balance, schedule, ac, experts
    )
    dims = MeshDims(world=world, pp=pp_, cp=cp, ep=ep)
    reference = build_model(cfg.model, seed=0, force_balance=benchmark, balance_ep=ep)
    model = build_model(cfg.model, seed=0, force_balance=benchmark, balance_ep=ep, device="meta")
    par = init_parallel(dims, torch.device("cpu"))
    parts, pipe = distribute(model, par, cfg)
    model = torch.nn.ModuleList(parts) if pipe is not None else parts[0]
    model.train()
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        ref_name = reference_name(name, pipe is not None)
        assert torch.equal(full_param(name, p, par), ref_params[ref_name]), ref_name
    dp_rank, cp_rank, dp_cp_rank = par.rank("dp"), par.rank("cp"), par.dp_cp_rank
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)

    for step in range(1, steps + 1):
        rows = step_rows(step, cfg.model.vocab_size)
        mine = []
        for inputs, labels in dp_microbatches(rows, micro_batch, dims.dp, dp_rank):
            positions = None
            if cp > 1:
                inputs, labels, positions = shard_batch(inputs, labels, cp, cp_rank)
            mine.append((inputs, labels, positions))
        n = len(mine)
        if pipe is not None:
            loss = pp.forward_backward(pipe, mine, nullcontext())
            loss, _ = pp.step_metrics(pipe, loss, model, torch.device("cpu"))
        else:
            set_aux_loss_grad_scale(model, 1.0 / n)
            offsets = [dims.token_offset(m, dp_cp_rank, micro_batch, SEQ) for m in range(n)]
            loss = forward_backward(model, mine, offsets=offsets, autocast=nullcontext())
        loss = loss.double()
        dist.all_reduce(loss, group=par.group("dp_cp"))
        loss = float(loss) / dims.dp_cp
        ref_loss = reference_step(reference, rows, micro_batch, dims.dp)
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL, msg=f"loss, step {step}")

        if step == 1:
            checked = 0
            for name, p in model.named_parameters():
                ref_name = reference_name(name, pipe is not None)
                torch.testing.assert_close(
                    full_grad(name, p, par),
                    ref_params[ref_name].grad,
                    rtol=RTOL,
                    atol=ATOL,
                    msg=lambda msg, n=ref_name: f"step-1 gradient of {n}: {msg}",
                )
                checked += 1
            assert checked
        norm = clip_grad_norm_(list(model.parameters()), max_grad_norm, par)
        ref_max = max_grad_norm if max_grad_norm > 0 else float("inf")
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), ref_max)
        torch.testing.assert_close(norm, ref_norm, rtol=RTOL, atol=ATOL, msg=f"norm, step {step}")
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    check_final_parameters(model, ref_params, par, pipelined=pipe is not None, steps=steps)


def check_final_parameters(model, ref_params, par, *, pipelined: bool, steps: int) -> None:
    """After the updates the models must still agree, parameter by parameter."""
    for name, p in model.named_parameters():
        ref_name = reference_name(name, pipelined)
        torch.testing.assert_close(
            full_param(name, p, par),
            ref_params[ref_name].detach(),
            rtol=RTOL,
            atol=ATOL,
            msg=lambda msg, n=ref_name: f"parameter {n} after {steps} steps: {msg}",
        )


def check_meshes(rank, world, cases):
    for case in cases:
        check_mesh(rank, world, **case)
