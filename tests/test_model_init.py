"""Building the model: per-unit initialisation, and no rank ever holds the full model.

The trainer builds the model on the meta device; parallelize.py drops the layers of other
pipeline stages and the experts of other EP ranks, then allocates and initialises what is left
(model.materialize). Checked here:
  * a layer has the same values whether or not the other layers exist (pipeline stages,
    interleaved too), and an EP rank's experts are exactly the full model's slice, under EP,
    PP x EP and for every EP rank (one process, no process group needed);
  * for real, on 4 gloo processes (ep4, and pp2 x ep2), with a model whose expert weights are
    400 MB: the growth of each process's peak resident memory (VmHWM) while building and
    parallelizing (FSDP included) is at least the experts the rank holds (the meter sees
    them) and at most what the rank holds + FSDP's copy of one layer's local experts + a
    quarter of ONE full layer's experts (below the full model, and below holding one full
    layer at a time); building the full model (the old way) in the same process grows it by
    at least the full model. Every parameter the rank holds equals (its slice of) the
    one-process model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from helpers.distributed import run_distributed

from moe_perf.common.config import ModelConfig, config_from_dict
from moe_perf.common.mesh import MeshDims
from moe_perf.trainer.ep import shard_experts_
from moe_perf.trainer.model import build_model, materialize
from moe_perf.trainer.moe import moe_layers
from moe_perf.trainer.parallelize import init_parallel
from moe_perf.trainer.pp import split_model
from moe_perf.trainer.train import distribute

TINY = Path(__file__).resolve().parents[1] / "conf" / "model" / "tiny.yaml"
SEED = 11


def model_config(**overrides) -> ModelConfig:
    """The tiny model with every initialised piece: a dense layer, shared experts with their
    gate, a router bias; 4 layers so that pipeline stages drop some."""
    raw = yaml.safe_load(TINY.read_text())
    raw.pop("defaults", None)  # a preset's Hydra defaults list is not a model field
    raw.update(
        num_layers=4,
        dense_layers=1,
        dense_ffn=64,
        num_shared_experts=1,
        shared_expert_ffn=32,
        shared_expert_gate=True,
        router_bias=True,
    )
    return dataclasses.replace(ModelConfig(**raw), **overrides)


def full_model(m: ModelConfig):
    return build_model(m, seed=SEED, force_balance=True)


def meta_model(m: ModelConfig):
    return build_model(m, seed=SEED, force_balance=True, device="meta")


def expected(full: dict, name: str, ep_rank: int, ep: int) -> torch.Tensor:
    """The full model's value of `name` as an EP rank holds it (its slice of expert weights)."""
    value = full[name]
    if ".experts." in name:
        L = value.shape[0] // ep
        value = value[ep_rank * L : (ep_rank + 1) * L]
    return value


def test_build_is_deterministic_and_every_unit_and_expert_differs():
    m = model_config()
    a, b = full_model(m), full_model(m)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    other = build_model(m, seed=SEED + 1, force_balance=True)
    assert not torch.equal(a.layers["2"].attention.wq.weight, other.layers["2"].attention.wq.weight)
    # Independent streams: layers, experts and weights do not repeat each other's values.
    assert not torch.equal(a.layers["1"].attention.wq.weight, a.layers["2"].attention.wq.weight)
    experts = a.layers["1"].ffn.experts
    w1, w3 = experts.w13[..., : experts.ffn], experts.w13[..., experts.ffn :]
    assert not torch.equal(w1[0], w1[1])
    assert not torch.equal(w1, w3)
    assert not torch.equal(w1, a.layers["2"].ffn.experts.w13[..., : experts.ffn])
    # The scales of the init survive the per-expert streams.
    assert 0.015 < float(w1.detach().std()) < 0.025
    assert torch.equal(a.layers["1"].ffn.router.gate.bias, torch.zeros(m.num_experts))
    assert all(int(moe.token_offset) == 0 for moe in moe_layers(a))


@pytest.mark.parametrize("pp,virtual", [(2, 1), (2, 2), (4, 1)])
def test_a_layer_is_the_same_with_or_without_the_other_layers(pp, virtual):
    """Pipeline stages cut from a meta model and materialized alone hold the full model's
    values: layer ids are global, nothing depends on the layers a stage lacks."""
    m = model_config()
    full = dict(full_model(m).named_parameters())
    seen = set()
    for pp_rank in range(pp):
        stages, _ = split_model(
            meta_model(m), pp_rank=pp_rank, pp=pp, virtual_stages=virtual, seq_len=16
        )
        for stage in stages:
            materialize(stage, "cpu", seed=SEED)
            assert len(stage.layers) < m.num_layers
            for name, p in stage.named_parameters():
                assert torch.equal(p, full[name]), name
                seen.add(name)
    assert seen == set(full)


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_ep_slices_equal_the_one_process_model(ep):
    """Experts sliced on the meta device, then materialized: every EP rank holds exactly its
    slice of the one-process model, and the same non-expert weights."""
    m = model_config()
    full = dict(full_model(m).named_parameters())
    for ep_rank in range(ep):
        model = meta_model(m)
        for moe in moe_layers(model):
            shard_experts_(moe.experts, ep_rank, ep)
        materialize(model, "cpu", seed=SEED)
        for name, p in model.named_parameters():
            assert torch.equal(p, expected(full, name, ep_rank, ep)), (ep_rank, name)
        assert all(int(moe.token_offset) == 0 for moe in moe_layers(model))


def test_pipeline_stage_with_ep_slices_equals_the_one_process_model():
    m = model_config()
    full = dict(full_model(m).named_parameters())
    for pp_rank in range(2):
        for ep_rank in range(2):
            stages, _ = split_model(
                meta_model(m), pp_rank=pp_rank, pp=2, virtual_stages=1, seq_len=16
            )
            for stage in stages:
                for moe in moe_layers(stage):
                    shard_experts_(moe.experts, ep_rank, 2)
                materialize(stage, "cpu", seed=SEED)
                for name, p in stage.named_parameters():
                    assert torch.equal(p, expected(full, name, ep_rank, 2)), name


# ---------------------------------------------------------------------------------------------
# Memory, for real: 4 processes


MiB = 2**20
BIG = dict(
    vocab_size=512,
    hidden=512,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    num_experts=16,
    top_k=2,
    expert_ffn=1024,
    dense_layers=0,
)  # experts: 4 layers x 16 x 3 x 512 x 1024 fp32 = 4 x 100.7 MB; the rest about 6 MB


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> None:
    """Reset the process's peak RSS (VmHWM) to its current RSS where the kernel lets us; where
    not, the peak is the process's lifetime one, which can only make the measured growth
    larger (a spurious failure, never a spurious pass)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


class PeakGrowth:
    """Growth of the peak resident memory (bytes) over the resident memory at entry."""

    def __enter__(self):
        _reset_peak()
        self.base = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        self.bytes = _status_kib("VmHWM") * 1024 - self.base


def _gathered(p) -> torch.Tensor:
    """The value of a parameter as the rank holds it before FSDP (its shards gathered)."""
    p = p.detach()
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _config(world: int, pp_: int, ep: int, **model):
    raw = {**yaml.safe_load(TINY.read_text()), **BIG, **model}
    return config_from_dict(
        {
            "model": raw,
            "mesh": {"nproc_per_node": world, "pp": pp_, "ep": ep},
            "dtype": {"name": "fp32"},
            "training": {
                "sequence_length": 16,
                "global_batch": 8,
                "micro_batch": 1,
                "seed": SEED,
            },
        }
    )


def _build(cfg, par):
    """The trainer's path (train.py): meta model, then parallelize (per stage under PP)."""
    m, ep = cfg.model, cfg.mesh.ep
    model = build_model(m, seed=SEED, force_balance=True, balance_ep=ep, device="meta")
    parts, pipe = distribute(model, par, cfg)
    return torch.nn.ModuleList(parts) if pipe is not None else parts[0]


def _nbytes(params) -> int:
    # DTensor.numel() is the size over its mesh: what the rank held before FSDP sharded it
    # (its EP slice of the experts, the whole of every other weight of its stages).
    return sum(p.numel() * p.element_size() for p in params)


def _check_memory(rank: int, world: int, pp_: int, ep: int) -> None:
    cfg = _config(world, pp_, ep)
    m = cfg.model
    par = init_parallel(MeshDims(world=world, pp=pp_, ep=ep), torch.device("cpu"))
    # The same path on a small model first: lazy imports and one-time set-up (FSDP, pipeline
    # stages) are not the model's memory.
    _build(_config(world, pp_, ep, hidden=64, expert_ffn=32, head_dim=16), par)

    with PeakGrowth() as built:
        model = _build(cfg, par)
    params = dict(model.named_parameters())
    held = _nbytes(params.values())
    held_experts = _nbytes(p for n, p in params.items() if ".experts." in n)
    layer_experts = m.num_experts * 3 * m.hidden * m.expert_ffn * 4  # one full layer, fp32
    # fully_shard copies a module's parameters into its own storage before the originals go:
    # up to one layer's local experts on top of what the rank holds.
    fsdp_copy = layer_experts // ep

    with PeakGrowth() as control:  # the old way: the full model in this process
        reference = build_model(m, seed=SEED, force_balance=True, balance_ep=ep)
    ref = dict(reference.named_parameters())
    full = _nbytes(ref.values())

    for name, p in params.items():
        ref_name = name.split(".", 1)[1] if pp_ > 1 else name  # stage index under PP
        want = expected(ref, ref_name, par.ep_rank, ep)
        assert torch.equal(_gathered(p), want), name

    figures = torch.tensor(
        [built.bytes, held, held_experts, control.bytes, full], dtype=torch.float64
    )
    every = [torch.zeros_like(figures) for _ in range(world)]
    dist.all_gather(every, figures)
    if rank == 0:
        for r, f in enumerate(every):
            b, h, he, c, fu = (float(x) / MiB for x in f)
            print(
                f"[memory] pp{pp_} ep{ep} rank {r}: build+parallelize peak growth {b:.1f} MiB; "
                f"held {h:.1f} MiB (experts {he:.1f}); full model {fu:.1f} MiB, building it "
                f"grew the peak by {c:.1f} MiB; one layer's experts {layer_experts / MiB:.1f} "
                "MiB",
                flush=True,
            )
    # The meter sees what is allocated: the full model when there is one, the slices here.
    assert control.bytes >= 0.95 * full, (control.bytes, full)
    assert built.bytes >= 0.9 * held_experts, (built.bytes, held_experts)
    # Never the full model, nor a full layer's experts on top of what the rank holds.
    bound = held + fsdp_copy + layer_experts // 4
    assert built.bytes <= bound, (built.bytes, held, fsdp_copy, layer_experts)
    assert bound < held + layer_experts and built.bytes < full / 2


def _has_peak_rss() -> bool:
    status = Path("/proc/self/status")
    return status.exists() and "VmHWM:" in status.read_text()


@pytest.mark.slow
@pytest.mark.skipif(not _has_peak_rss(), reason="needs Linux /proc/self/status (VmHWM)")
@pytest.mark.parametrize("pp_,ep", [(1, 4), (2, 2)], ids=["ep4", "pp2-ep2"])
def test_no_rank_ever_holds_the_full_model(pp_, ep):
    """Figures: `pytest -s` prints them (rank 0, one line per rank)."""
    run_distributed(_check_memory, 4, pp_, ep)
