"""A step's figures before they mean anything: the run's shape, what a printed value may be,
and one step printed by several ranks made one."""

from __future__ import annotations

import math
from dataclasses import dataclass

METRIC_KEYS = ("step_time_s", "tokens_per_s", "peak_mem_gib", "loss", "tflops", "mfu")


@dataclass(frozen=True)
class RunShape:
    """What the run's shape says, where known: global tokens per step and the device count."""

    global_batch: int | None = None
    seq_length: int | None = None
    world_size: int | None = None

    @classmethod
    def of_config(cls, cfg) -> RunShape:
        """From a composed (or resolved) config: training.{global_batch,sequence_length}, mesh."""
        world = int(cfg["mesh"]["nnodes"]) * int(cfg["mesh"]["nproc_per_node"])
        training = cfg["training"]
        return cls(int(training["global_batch"]), int(training["sequence_length"]), world)

    def tokens_per_step(self, line_batch: float | None = None) -> float | None:
        batch = self.global_batch or line_batch
        return batch * self.seq_length if batch and self.seq_length else None


def known(value: float | None) -> float | None:
    """Non-finite and negative values are unknown, never results."""
    if value is None or not math.isfinite(value) or value < 0:
        return None
    return value


def finite(value: float | None) -> float | None:
    """A loss may be negative (a user's objective, a log-likelihood); only nan and inf are
    unknown."""
    return value if value is not None and math.isfinite(value) else None


def positive(value: float | None) -> float | None:
    """0 TFLOP/s, 0 MFU, a 0 s step: not computed, so unknown."""
    value = known(value)
    return value if value else None


# what a figure may be, where it is not `known` (finite and non-negative)
VALUE_RULES = {"tflops": positive, "mfu": positive, "loss": finite}


def as_known(sample: dict) -> dict:
    """The sample with each metric it has kept only where it may be that metric."""
    for key in METRIC_KEYS:
        if key in sample:
            sample[key] = VALUE_RULES.get(key, known)(sample[key])
    return sample


def value_problems(raw: dict) -> list[str]:
    """A step time or tokens/s printed as nan, inf, 0 or negative is a problem: the log is no
    result (an empty value is unknown, and fine)."""
    problems = []
    for key in ("step_time_s", "tokens_per_s", "tokens_per_s_device"):
        value = raw.get(key)
        if value is not None and not (math.isfinite(value) and value > 0):
            problems.append(f"step {raw['step']}: {key}={value:g} is not a positive number")
    return problems


def figures(raw: dict) -> dict:
    """A step line's figures, for telling a repeated line from a different one."""
    return {k: v for k, v in raw.items() if k != "timestamp"}


def combine(raws: list[dict]) -> dict:
    """One step printed by several ranks (or repeated): the slowest rank's time and throughput,
    the largest memory, the first loss that is a loss (non-last pipeline stages print none)."""

    def pick(key, choose):
        rule = finite if key == "loss" else known
        values = [v for v in (rule(r.get(key)) for r in raws) if v is not None]
        return choose(values) if values else None

    first = raws[0]
    return {
        "step": first["step"],
        "max_steps": first.get("max_steps"),
        "timestamp": pick("timestamp", max),
        "step_time_s": positive(pick("step_time_s", max)),
        "tokens_per_s": positive(pick("tokens_per_s", min)),
        "tokens_per_s_device": positive(pick("tokens_per_s_device", min)),
        "peak_mem_gib": pick("peak_mem_gib", max),
        "loss": pick("loss", lambda v: v[0]),
        "tflops": positive(pick("tflops", min)),
        "mfu": positive(pick("mfu", min)),
        "global_batch": pick("global_batch", lambda v: v[0]),
        "skipped": pick("skipped", max),
        "ranks": len(raws),
    }
