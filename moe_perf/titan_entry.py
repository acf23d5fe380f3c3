"""torchtitan's own training main, after registering a derived flavor in-process.

    python -m moe_perf.titan_entry --cli 0.2 --model qwen3 --base 30B-A3B \\
        --as 30B-A3B-4layers --num-layers 4 -- <torchtitan's flags>

torchtitan has no flag for the depth (nor, in 0.3.x, for float8): the flavor is a Python
value. This registers a copy of `--base` under `--as`, with the first `--num-layers` layers
(and, `--float8`, the float8 linear converter applied) and then runs torchtitan's main on the
flags after `--`, in which `--as` names the model. It runs in every torchrun rank, so it
imports only torchtitan (the worktree's, first on PYTHONPATH) and never Hydra: it lives at the
package root because `moe_perf.frameworks` imports OmegaConf.

0.2.x: the flavor table is the `model_args` of the model's TrainSpec; the copy goes into a
TrainSpec registered under the same name (torchtitan looks up registered specs first).
0.3.x: the flavor is a function of `torchtitan.models.<model>.config_registry`, which
torchtitan's ConfigManager looks up by `--config`; the copy is added to that module.

routing=skew (`--skew IMBALANCE` and its plan's other knobs): torchtitan's router, under
`--debug.moe_force_load_balance`, replaces its top-k by what its `_debug_force_load_balance_routing`
method returns; this replaces that method, in every router class that has it, by the skew plan
of common/routing.py (the reference trainer's SkewedSlots), made for the tokens of each call.
torchtitan numbers a call's tokens from 0 on every rank; a plan of that many tokens is one
whole period, so every call gets exactly the planned counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import os
import sys


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise SystemExit("moe_perf.titan_entry: expected `-- <torchtitan flags>` after its own")
    cut = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m moe_perf.titan_entry")
    parser.add_argument("--cli", choices=["0.2", "0.3"], required=True)
    parser.add_argument("--model", required=True, help="torchtitan model (0.2 name, 0.3 module)")
    parser.add_argument("--base", required=True, help="flavor (0.2) or config function (0.3)")
    parser.add_argument("--as", dest="name", required=True, help="key of the derived copy")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--float8", action="store_true", help="0.3: float8 linear converter")
    parser.add_argument("--skew", type=float, default=None, help="routing.imbalance (skew)")
    parser.add_argument("--skew-shape", default="hot", help="routing.shape")
    parser.add_argument("--skew-hot-experts", type=int, default=1, help="routing.hot_experts")
    parser.add_argument("--skew-hot-ranks", type=int, default=1, help="routing.hot_ranks")
    parser.add_argument("--skew-ep", type=int, default=1, help="mesh.ep")
    parser.add_argument("--skew-tokens", type=int, default=None, help="tokens of a router call")
    parser.add_argument("--skew-experts", type=int, default=None, help="model.num_experts")
    parser.add_argument("--skew-top-k", type=int, default=None, help="model.top_k")
    return parser.parse_args(argv[:cut]), argv[cut + 1 :]


# Where torchtitan's routers live (0.2.x; later trees under models/common) and the method that
# `--debug.moe_force_load_balance` calls with the router's scores ([T, E], or [B, L, E] in
# later trees) for (expert ids, their scores).
ROUTER_MODULES = (
    "torchtitan.models.moe.moe",
    "torchtitan.models.common.moe",
    "torchtitan.models.common.moe.moe",
)
FORCED_ROUTING = "_debug_force_load_balance_routing"


def skewed_routing(request: dict, expected: tuple | None = None):
    """A replacement for torchtitan's forced routing: the skew plan's ids for the call's T
    tokens, the router's real scores gathered at them. The plans and their E slot ends live in
    a table by (tokens, experts, top-k, device); `expected`, such a key, is made here, before
    torchtitan compiles its blocks, so that a compiled router only reads it."""
    from moe_perf.common.routing import skew_plan
    from moe_perf.trainer.routing import SkewedSlots

    slots_by_call: dict = {}

    def slots_for(T: int, E: int, K: int, device) -> SkewedSlots:
        key = (T, E, K, device)
        if key not in slots_by_call:
            plan = skew_plan(num_experts=E, top_k=K, tokens=T, **request)
            slots_by_call[key] = SkewedSlots(plan, device)
        return slots_by_call[key]

    if expected is not None:
        slots_for(*expected)

    def routing(self, scores):
        E = scores.shape[-1]
        scores_TE = scores.reshape(-1, E)
        T = scores_TE.shape[0]
        ids_TK = slots_for(T, E, self.top_k, scores.device).expert_ids(0, T, scores.device)
        top_TK = scores_TE.gather(1, ids_TK)
        shape = (*scores.shape[:-1], ids_TK.shape[1])
        return ids_TK.reshape(shape), top_TK.reshape(shape)

    return routing


def install_skew(request: dict, expected: tuple | None = None) -> list[str]:
    """Every torchtitan router class with the forced-routing method gets the skew plan's
    (`expected`: see skewed_routing); returns their names (none found: a SystemExit)."""
    patched = []
    for name in ROUTER_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for cls in vars(module).values():
            if isinstance(cls, type) and FORCED_ROUTING in vars(cls):
                setattr(cls, FORCED_ROUTING, skewed_routing(request, expected))
                patched.append(f"{name}.{cls.__name__}")
    if not patched:
        raise SystemExit(
            f"moe_perf.titan_entry: routing=skew needs a torchtitan router with "
            f"{FORCED_ROUTING} in one of {', '.join(ROUTER_MODULES)}; this torchtitan has none"
        )
    return patched


def skew_request(ours: argparse.Namespace) -> dict:
    return {"ep": ours.skew_ep, "imbalance": ours.skew, "shape": ours.skew_shape,
            "hot_experts": ours.skew_hot_experts, "hot_ranks": ours.skew_hot_ranks}  # fmt: skip


def expected_call(ours: argparse.Namespace) -> tuple | None:
    """(tokens, experts, top-k, device) of this rank's router calls, as our flags give them
    (the device: torchtitan's, cuda:LOCAL_RANK)."""
    if ours.skew_tokens is None:
        return None
    import torch

    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return ours.skew_tokens, ours.skew_experts, ours.skew_top_k, device


def cut_model_args(args, num_layers: int):
    """0.2 model args with `num_layers` layers; leading dense layers kept (DeepSeek's first)."""
    changes = {"n_layers": num_layers}
    if hasattr(args, "n_dense_layers"):
        changes["n_dense_layers"] = min(args.n_dense_layers, num_layers)
    return dataclasses.replace(args, **changes)


def register_flavor(model: str, base: str, name: str, num_layers: int | None) -> None:
    """0.2.x: a TrainSpec like the model's, whose flavor table also holds `name`."""
    from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

    spec = get_train_spec(model)
    if base not in spec.model_args:
        raise SystemExit(f"moe_perf.titan_entry: torchtitan's {model} has no flavor {base}")
    derived = spec.model_args[base]
    if num_layers:
        derived = cut_model_args(derived, num_layers)
    flavors = {**spec.model_args, name: derived}
    register_train_spec(model, dataclasses.replace(spec, model_args=flavors))


def register_config(model: str, base: str, name: str, num_layers: int | None, float8: bool,
                    compile_model: bool) -> None:  # fmt: skip
    """0.3.x: a config function `name` beside `base` in the model's config_registry."""
    registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
    base_fn = getattr(registry, base, None)
    if base_fn is None:
        raise SystemExit(f"moe_perf.titan_entry: torchtitan's {model} has no config {base}")

    def derived():
        config = base_fn()
        spec = config.model_spec
        model_config = spec.model
        if num_layers:
            layers = list(model_config.layers)[:num_layers]
            model_config = dataclasses.replace(model_config, layers=layers)
        if float8:
            from torchtitan.components.quantization import Float8LinearConverter

            # the output head and the router stay in bf16, as torchtitan's own float8 configs do
            converter = Float8LinearConverter.Config(
                filter_fqns=["lm_head", "router.gate"], model_compile_enabled=compile_model
            ).build()
            model_config = converter.convert(model_config)
        config.model_spec = dataclasses.replace(spec, model=model_config)
        return config

    derived.__name__ = derived.__qualname__ = name
    setattr(registry, name, derived)


def main(argv: list[str] | None = None) -> None:
    ours, titan_args = parse(list(sys.argv[1:] if argv is None else argv))
    # torchtitan 0.2 binds `sys.argv[1:]` as parse_args' default when its config module is
    # imported: torchtitan's flags must be in place before the first torchtitan import
    sys.argv = [sys.argv[0], *titan_args]
    if ours.cli == "0.2":
        register_flavor(ours.model, ours.base, ours.name, ours.num_layers)
    else:
        compile_model = "--compile.enable" in titan_args
        register_config(ours.model, ours.base, ours.name, ours.num_layers, ours.float8,
                        compile_model)  # fmt: skip
    if ours.skew is not None:
        install_skew(skew_request(ours), expected_call(ours))
    train = importlib.import_module("torchtitan.train")
    if inspect.signature(train.main).parameters:  # 0.2: main(trainer_class)
        train.main(train.Trainer)
    else:
        train.main()


if __name__ == "__main__":
    main()
