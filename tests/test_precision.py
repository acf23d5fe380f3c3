"""bf16 compute weights over fp32 masters on one data x context rank (trainer/precision.py):
what the optimizer trains, how gradients accumulate over micro-batches, and the real trainer's
steps with it (CPU, bf16)."""

from __future__ import annotations

import importlib.util
import io

import pytest
import torch
from helpers.trainer_run import write_config
from torch import nn

from moe_perf.common.config import load_config
from moe_perf.trainer import precision, train
from moe_perf.trainer.model import build_model
from moe_perf.trainer.parallelize import init_parallel, parallelize


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(32, 16), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4)
    )


def test_compute_weights_are_bf16_and_gradients_accumulate_in_fp32_per_micro_batch():
    model, twin = small_model(), small_model()
    originals = [p.detach().clone() for p in model.parameters()]
    mw = precision.MasterWeights(model, torch.bfloat16, keep_fp32=(model[0],))

    emb, *rest = list(model.parameters())
    assert emb.dtype == torch.float32 and all(p.dtype == torch.bfloat16 for p in rest)
    assert [m.dtype for m in mw.masters] == [torch.float32] * len(originals)
    assert mw.masters[0] is emb  # the embedding trains as it is
    for master, original in zip(mw.masters, originals, strict=True):
        assert torch.equal(master, original)
    assert precision.optimizer_params(nn.Sequential()) == []

    # the twin computes each micro-batch's bf16 gradients by hand
    for p in list(twin.parameters())[1:]:
        p.data = p.data.to(torch.bfloat16)
    expected = [torch.zeros_like(p, dtype=torch.float32) for p in twin.parameters()]
    for seed in (1, 2):
        tokens = torch.randint(0, 32, (8,), generator=torch.Generator().manual_seed(seed))
        model(tokens).float().square().sum().backward()
        twin.zero_grad(set_to_none=True)
        twin[1:](twin[0](tokens).to(torch.bfloat16)).float().square().sum().backward()
        for acc, p in zip(expected, twin.parameters(), strict=True):
            acc += p.grad.float()
    assert model[0](torch.tensor([1])).dtype == torch.bfloat16  # the residual stream's dtype
    assert all(p.grad is None for p in rest)  # dropped once added to the master's
    for master, acc in zip(mw.masters, expected, strict=True):
        assert master.grad.dtype == torch.float32
        torch.testing.assert_close(master.grad, acc, rtol=0, atol=0)

    with torch.no_grad():
        for master in mw.masters:
            master.add_(0.5)
    mw.copy_to_model()
    for p, master in zip(rest, mw.masters[1:], strict=True):
        assert torch.equal(p, master.to(torch.bfloat16))


def test_the_trainer_steps_the_masters_and_copies_them_into_the_model(tmp_path):
    cfg = load_config(
        str(write_config(tmp_path, dtype={"name": "bf16", "fp8": False})),
        ["training.global_batch=4", "training.micro_batch=2"],
    )
    tr = train.build(cfg, io.StringIO())
    (model,) = tr.parts
    mw = precision.master_weights(model)
    assert mw is not None and tr.params == mw.masters
    assert model.output.weight.dtype == torch.bfloat16
    assert model.tok_embeddings.weight.dtype == torch.float32
    before = [m.detach().clone() for m in mw.masters]
    losses = []
    for step in (1, 2, 3):
        loss, _ = train.train_step(tr, train.local_batch(tr, step))
        losses.append(float(loss))
        for p, master in zip(mw.compute, mw.compute_masters, strict=True):
            assert torch.equal(p, master.detach().to(torch.bfloat16))
    moved = [not torch.equal(b, m) for b, m in zip(before, mw.masters, strict=True)]
    assert all(moved)

    # the same steps in fp32: bf16 compute follows them closely
    (tmp_path / "fp32").mkdir()
    fp32 = load_config(
        str(write_config(tmp_path / "fp32")), ["training.global_batch=4", "training.micro_batch=2"]
    )
    ref = train.build(fp32, io.StringIO())
    assert precision.master_weights(ref.parts[0]) is None
    ref_losses = [float(train.train_step(ref, train.local_batch(ref, s))[0]) for s in (1, 2, 3)]
    assert losses[0] != losses[2]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=5e-3, atol=0)


FP8 = {"name": "fp8", "fp8": True}


@pytest.mark.parametrize(
    "dtype,switch,mesh,expected",
    [
        ({"name": "bf16"}, False, {}, True),
        ({"name": "fp32"}, True, {}, False),
        (FP8, False, {}, False),  # autocast over fp32 weights, as measured so far
        (FP8, True, {}, True),
        ({"name": "bf16", "fp8": True}, True, {}, True),  # the fp8 flag is fp8
        (FP8, True, {"nproc_per_node": 2, "ep": 2}, False),  # FSDP's mixed precision instead
        ({"name": "bf16"}, False, {"nproc_per_node": 2}, False),
    ],
)
def test_which_runs_have_master_weights(tmp_path, dtype, switch, mesh, expected):
    overrides = [f"trainer.fp8_master_weights={switch}"]
    overrides += [f"mesh.{k}={v}" for k, v in mesh.items()]
    cfg = load_config(str(write_config(tmp_path, dtype=dtype)), overrides)
    assert cfg.master_weights is expected


@pytest.mark.parametrize("switch", [False, True])
def test_parallelize_gives_fp8_bf16_compute_weights_over_fp32_masters_with_its_switch(
    tmp_path, switch
):
    """dtype=fp8 on one rank: with trainer.fp8_master_weights the bf16 path's MasterWeights
    (torchao's Float8Linear, applied before parallelize, then casts bf16 weights to fp8 itself);
    without it every weight stays fp32 under autocast. The float8 conversion needs torchao
    and a GPU; the weights' precision is parallelize's alone, checked here without them."""
    cfg = load_config(str(write_config(tmp_path, dtype=FP8)),
                      [f"trainer.fp8_master_weights={switch}"])  # fmt: skip
    model = build_model(cfg.model, seed=cfg.training.seed, force_balance=True, device="meta")
    model = parallelize(model, init_parallel(cfg.mesh_dims, torch.device("cpu")), cfg)
    mw = precision.master_weights(model)
    if not switch:
        assert mw is None
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        return
    assert model.tok_embeddings.weight.dtype == torch.float32
    assert model.layers["0"].attention.wq.weight.dtype == torch.bfloat16
    assert {p.dtype for p in mw.compute} == {torch.bfloat16}
    assert {p.dtype for p in mw.masters} == {torch.float32}
    assert len(mw.masters) == len(list(model.parameters()))


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
def test_torchaos_float8_linear_over_bf16_weights_gives_the_masters_fp32_gradients():
    """The composition trainer.fp8_master_weights relies on: a Float8Linear whose weight is a
    bf16 compute copy runs forward and backward and hands its bf16 gradient to the master's
    hook, which accumulates it in fp32 (on the CPU as torchao's emulation runs it)."""
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 64), nn.Linear(64, 64), nn.Linear(64, 16))
    convert_to_float8_training(model)
    mw = precision.MasterWeights(model, torch.bfloat16, keep_fp32=(model[0],))
    assert type(model[1]).__name__ == "Float8Linear" and model[1].weight.dtype == torch.bfloat16
    tokens = torch.randint(0, 32, (16,))
    for _ in range(2):  # two micro-batches
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(tokens).float().square().sum().backward()
    for master in mw.compute_masters:
        assert master.grad is not None and master.grad.dtype == torch.float32
        assert torch.isfinite(master.grad).all() and master.grad.abs().sum() > 0
    assert all(p.grad is None for p in mw.compute)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_the_residual_stream_stays_bf16_under_the_devices_autocast(tmp_path, device):
    """Every block, norm and MoE layer of the trainer's bf16 model hands on bf16 under its
    device's autocast. CUDA's runs rms_norm and sum in fp32 and returns fp32 (CPU's does not):
    the residual stream was fp32 on GPUs from the first MoE layer on."""
    cfg = load_config(
        str(write_config(tmp_path, dtype={"name": "bf16", "fp8": False})),
        ["training.global_batch=2", "training.micro_batch=2", f"training.device={device}",
         "model.num_layers=3"],
    )  # fmt: skip
    tr = train.build(cfg, io.StringIO())
    (model,) = tr.parts
    seen = {}

    def record(name):
        def hook(module, args, out):
            seen[name] = out.dtype

        return hook

    for name, module in model.named_modules():
        if name.startswith("layers.") and name.count(".") <= 2 and "attention." not in name:
            module.register_forward_hook(record(name))
    inputs, _, positions = train.local_batch(tr, 1)[0]
    with tr.autocast:
        model(inputs, positions)
    assert {"layers.2", "layers.2.ffn", "layers.2.ffn_norm"} <= set(seen)
    assert {name: dt for name, dt in seen.items() if dt != torch.bfloat16} == {}


def test_clipping_rides_on_the_fused_optimizer_step(tmp_path):
    """One rank, plain tensors: the clip is the fused AdamW's grad_scale, not a pass of its own;
    the step lands where clipping the gradients by hand and stepping does."""
    overrides = ["training.global_batch=4", "training.micro_batch=2", "trainer.max_grad_norm=0.01"]
    runs = {}
    for folded in (True, False):
        (tmp_path / str(folded)).mkdir()
        cfg = load_config(str(write_config(tmp_path / str(folded))), overrides)
        tr = train.build(cfg, io.StringIO())
        assert tr.clip_in_optimizer
        tr.clip_in_optimizer = folded
        train.train_step(tr, train.local_batch(tr, 1))
        runs[folded] = [p.detach().clone() for p in tr.params]
        if folded:
            assert float(tr.optimizer.grad_scale) > 1  # the clip was active
    for a, b in zip(runs[True], runs[False], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n", [1, 4095, 4096, 3 * 4096 + 17, 2_000_003])
def test_gpu_gradient_accumulation_is_bit_identical_to_aten(n):
    """The Triton fp32 += bf16 (and the first micro-batch's cast) against ATen's, bit for bit."""
    g = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    acc = torch.randn(n, device="cuda")
    expected = acc.clone().add_(g)
    assert torch.equal(precision.accumulate_(acc, g), expected)
    assert torch.equal(precision.cast_fp32(g), g.float())
    assert precision.triton_kernels() is not None  # the Triton path ran, not the fallback


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_master_adamw_steps_like_torchs_fused_adamw_and_writes_the_copies():
    """The one-pass step (Triton) against torch's fused AdamW followed by the copies, with a
    clip scale, over 3 steps; the bf16 copies are exactly the masters' values."""
    torch.manual_seed(0)

    def model():
        torch.manual_seed(1)
        return nn.Sequential(nn.Embedding(50, 64), nn.Linear(64, 4097), nn.Linear(4097, 33)).cuda()

    ours, ref = model(), model()
    mw, mw_ref = (
        precision.MasterWeights(m, torch.bfloat16, keep_fp32=(m[0],)) for m in (ours, ref)
    )
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    opt = precision.MasterAdamW(mw.masters, [mw], **kwargs)
    opt_ref = torch.optim.AdamW(mw_ref.masters, fused=True, **kwargs)
    assert opt._one_pass()
    for step in range(3):
        scale = torch.tensor(1.0 + step, device="cuda")
        for a, b in zip(mw.masters, mw_ref.masters, strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt.grad_scale = opt_ref.grad_scale = scale
        opt.step()
        opt_ref.step()
        mw_ref.copy_to_model()
        for a, b in zip(mw.masters, mw_ref.masters, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(opt.state[a]["exp_avg_sq"], opt_ref.state[b]["exp_avg_sq"])
        for p, master in zip(mw.compute, mw.compute_masters, strict=True):
            assert torch.equal(p, master.to(torch.bfloat16))
    assert float(opt.state[mw.masters[1]]["step"]) == 3
