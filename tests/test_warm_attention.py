"""trainer.warm_attention on the CPU (on a GPU it takes cuDNN's first use out of step 1): the
warm-up makes the model's own attention call, at the step's shapes, layout and dtype, forward
and backward, in a thread of its own during the build; the global generators, which the
model's init and data read, stay the model's; off (the default) starts no thread at all."""

from __future__ import annotations

import dataclasses
import io
import json
import threading

import pytest
import torch
from helpers.trainer_run import write_config

from moe_perf.common.config import TrainerConfig, load_config
from moe_perf.trainer import runtime, train

SHAPES = ["training.global_batch=4", "training.micro_batch=2", "training.max_steps=2"]


class CallLog:
    """SDPA's calls as the real function runs them: who called, with what tensors."""

    def __init__(self) -> None:
        self.real = torch.nn.functional.scaled_dot_product_attention
        self.calls: list[dict] = []

    def __call__(self, q, k, v, **kwargs):
        self.calls.append({
            "thread": threading.current_thread().name,
            "tensors": [(t.shape, t.stride(), t.dtype) for t in (q, k, v)],
            "kwargs": kwargs,
        })  # fmt: skip
        return self.real(q, k, v, **kwargs)


@pytest.fixture
def sdpa_calls(monkeypatch) -> CallLog:
    log = CallLog()
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", log)
    return log


class ThreadStarts:
    """The names of the Python threads started while it is on (threading.settrace reaches every
    thread the threading module starts, at its first call)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def __enter__(self):
        threading.settrace(self._seen)
        return self

    def _seen(self, frame, event, arg):
        self.names.append(threading.current_thread().name)
        return None

    def __exit__(self, *exc) -> None:
        threading.settrace(None)


def built(tmp_path, dtype: str, *overrides: str):
    cfg = load_config(str(write_config(tmp_path, dtype={"name": dtype, "fp8": False})),
                      [*SHAPES, *overrides])  # fmt: skip
    with ThreadStarts() as started:
        tr = train.build(cfg, io.StringIO())
    return tr, started.names


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_warm_up_makes_the_models_own_attention_call_in_its_thread(tmp_path, sdpa_calls,
                                                                        dtype):  # fmt: skip
    tr, started = built(tmp_path, dtype, "trainer.warm_attention=true")
    assert runtime.WARM_ATTENTION_THREAD in started
    (warm_up_call,) = sdpa_calls.calls  # the build's only call, from the warm-up's thread
    assert warm_up_call["thread"] == runtime.WARM_ATTENTION_THREAD
    warm = tr.attention_warm_up
    assert warm is not None and not warm.thread.is_alive()
    assert warm.error is None and warm.seconds >= 0 and warm.waited_s >= 0

    train.train_step(tr, train.local_batch(tr, 1))  # the step's calls, on the main thread
    step_calls = sdpa_calls.calls[1:]
    assert len(step_calls) == 2 * tr.cfg.model.num_layers  # 2 micro-batches
    # shapes, strides (q and k as RoPE leaves them, v the projection's view) and dtype
    for call in step_calls:
        assert call["thread"] == threading.current_thread().name
        assert call["tensors"] == warm_up_call["tensors"]
        assert call["kwargs"] == warm_up_call["kwargs"]
    (q_shape, _, q_dtype), (k_shape, _, _), _ = warm_up_call["tensors"]
    m = tr.cfg.model
    assert q_shape == (2, m.num_heads, 64, m.head_dim) and k_shape[1] == m.num_kv_heads
    assert q_dtype == (torch.bfloat16 if dtype == "bf16" else torch.float32)


def test_off_starts_no_thread_and_makes_no_call(tmp_path, sdpa_calls):
    assert TrainerConfig().warm_attention is True  # the default, measured on an H100
    tr, started = built(tmp_path, "bf16", "trainer.warm_attention=false")
    assert tr.cfg.trainer.warm_attention is False
    assert runtime.WARM_ATTENTION_THREAD not in started
    assert sdpa_calls.calls == [] and tr.attention_warm_up is None


def test_the_global_generators_stay_the_models(tmp_path):
    """The warm-up draws nothing from the global generator, so a run with it initialises and
    trains exactly as one without it."""
    cfg = load_config(str(write_config(tmp_path)), SHAPES)
    before = torch.get_rng_state()
    warm = runtime.warm_attention_in_background(cfg.model, 2, 64, torch.bfloat16,
                                                torch.device("cpu"))  # fmt: skip
    warm.join()
    assert warm.error is None and torch.equal(before, torch.get_rng_state())

    runs = {}
    for switch in ("false", "true"):
        (tmp_path / switch).mkdir()
        tr, _ = built(tmp_path / switch, "bf16", f"trainer.warm_attention={switch}")
        assert (tr.attention_warm_up is not None) == (switch == "true")
        weights = [p.detach().clone() for p in tr.params]
        losses = [float(train.train_step(tr, train.local_batch(tr, s))[0]) for s in (1, 2)]
        runs[switch] = weights, losses, torch.get_rng_state()
    (w_off, loss_off, rng_off), (w_on, loss_on, rng_on) = runs["false"], runs["true"]
    assert all(torch.equal(a, b) for a, b in zip(w_off, w_on, strict=True))
    assert loss_off == loss_on and torch.equal(rng_off, rng_on)


def test_a_call_sdpa_refuses_ends_the_thread_with_the_reason(tmp_path):
    cfg = load_config(str(write_config(tmp_path)), SHAPES)
    gqa = dataclasses.replace(cfg.model, num_heads=3, num_kv_heads=2)  # 3 heads over 2 groups
    warm = runtime.warm_attention_in_background(gqa, 2, 64, torch.float32, torch.device("cpu"))
    warm.join()
    assert not warm.thread.is_alive()
    assert warm.error is not None and warm.error.startswith("RuntimeError")
    assert warm.summary()["error"] == warm.error


def test_not_under_context_parallel(tmp_path):
    """cp.py's attention makes other calls (sequence chunks, explicit masks): no warm-up."""
    raw = ["trainer.warm_attention=true", "mesh.nproc_per_node=2", "mesh.cp=2"]
    cfg = load_config(str(write_config(tmp_path)), [*SHAPES, *raw])
    assert train.start_attention_warm_up(cfg, cfg.mesh_dims, torch.device("cpu")) is None


def test_startup_json_says_what_the_warm_up_took(tmp_path):
    cfg = load_config(str(write_config(tmp_path, dtype={"name": "bf16", "fp8": False})),
                      [*SHAPES, "trainer.warm_attention=true"])  # fmt: skip
    train.run(cfg, out=io.StringIO(), startup_path=tmp_path / "startup.json")
    info = json.loads((tmp_path / "startup.json").read_text())["attention_warm_up"]
    assert info["error"] is None and info["seconds"] >= 0 and info["waited_s"] >= 0
