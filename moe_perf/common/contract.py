"""The trainer contract: the one per-step line the runner parses, and the env line.

Any trainer (the reference trainer, or a user's framework) prints, from one rank, once per
optimizer step::

    [moe_perf] step=3/8 step_time_s=0.41 tokens_per_s=159021 peak_mem_gib=12.4 loss=10.8 mfu=0.3

`step`, `step_time_s`, `tokens_per_s` and `peak_mem_gib` are required; `loss`, `tflops`
(model TFLOP/s per GPU, e.g. `tflops=301.2`) and `mfu` (fraction of peak, 0..1) are
optional. Other `key=value` pairs are kept as they are. Values are plain decimal numbers; an
empty value means "unknown".
Optionally, once, a line `[moe_perf] env {json}` describes the software and devices.

Pure Python: the runner and the trainer both import it.
"""

from __future__ import annotations

import json
import re

PREFIX = "[moe_perf]"
REQUIRED = ("step_time_s", "tokens_per_s", "peak_mem_gib")
OPTIONAL = ("loss", "tflops", "mfu")
# Every per-step metric, in the order records and tables show them.
METRICS = REQUIRED + OPTIONAL

# torchrun --tee prefixes lines with "[rank0]:" (or "[default0]:"); the prefix may also sit
# after a timestamp written by a user's logger, so search rather than anchor.
_STEP_RE = re.compile(r"\[moe_perf\] step=(\d+)/(\d+)((?: +[A-Za-z_][\w/]*=\S*)*)")
_ENV_RE = re.compile(r"\[moe_perf\] env (\{.*\})\s*$")
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


def format_step(step: int, max_steps: int, **values: float | None) -> str:
    """One contract line. `None` values are written empty (unknown), never as 0."""
    missing = [k for k in REQUIRED if k not in values]
    if missing:
        raise ValueError(f"step line needs {missing}")
    parts = [f"{PREFIX} step={step}/{max_steps}"]
    for key, value in values.items():
        parts.append(f"{key}=" + ("" if value is None else f"{value:.6g}"))
    return " ".join(parts)


def format_env(env: dict) -> str:
    return f"{PREFIX} env {json.dumps(env, sort_keys=True)}"


def _number(text: str) -> float | None:
    if text == "":
        return None
    try:
        return float(text)
    except ValueError:
        return None


def parse_step(line: str) -> dict | None:
    """The sample of one contract line, or None if the line is not one."""
    m = _STEP_RE.search(_ANSI_RE.sub("", line))
    if not m:
        return None
    sample: dict = {"step": int(m.group(1)), "max_steps": int(m.group(2))}
    for pair in m.group(3).split():
        key, _, value = pair.partition("=")
        sample[key] = _number(value)
    if any(sample.get(k) is None for k in REQUIRED):
        return None
    return sample


def parse_env(line: str) -> dict | None:
    m = _ENV_RE.search(_ANSI_RE.sub("", line))
    if not m:
        return None
    try:
        return json.loads(m.group(1))
    except json.JSONDecodeError:
        return None
