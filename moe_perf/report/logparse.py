"""Per-step samples from console logs: our contract line, torchtitan's and Megatron-LM's.

Each adapter turns one framework's per-step log line into the contract's sample dict
(`step`, `step_time_s`, `tokens_per_s`, `peak_mem_gib`, `loss`, `tflops`, `mfu`), with `None`
where the framework does not print the value, so a user's framework log can be compared the
same way as a reference-trainer log. Line formats: REFERENCE §4.

What each framework gives, and what it does not:

* torchtitan (`--metrics.log_freq 1`): `tps` is tokens/s PER DEVICE (our contract's is global)
  and `memory` is peak reserved GiB. It prints no step time: pass `tokens_per_step` (tokens per
  step per device, local batch x sequence length) to derive `step_time_s = tokens_per_step / tps`.
  `mfu` is printed in percent (or `N/A` under FP8) and is stored as a fraction.
* Megatron-LM (`--log-interval 1 --log-throughput`): step time from "elapsed time per iteration
  (ms)", TFLOP/s per GPU, lm loss. Tokens/s needs the sequence length (`seq_length`): global
  batch size x sequence length / step time. Peak memory comes from the separate "memory (MB)"
  report (max reserved), printed once or a few times: its maximum is given to every step.

Both frameworks average their values over the log interval, hence the interval-1 flags.
Pure Python.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from moe_perf.common.contract import parse_env, parse_step

FORMATS = ("contract", "titan", "megatron")
METRIC_KEYS = ("step_time_s", "tokens_per_s", "peak_mem_gib", "loss", "tflops", "mfu")

_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
_NUM = r"([-+]?[\d,]*\.?\d+(?:[eE][-+]?\d+)?|N/A)"

_TITAN_STEP_RE = re.compile(r"\bstep:\s*(\d+)\s+loss:")
_TITAN_FIELDS = {
    "loss": re.compile(r"\bloss:\s*" + _NUM),
    "peak_mem_gib": re.compile(r"\bmemory:\s*" + _NUM + r"\s*GiB"),
    "tokens_per_s": re.compile(r"\btps:\s*" + _NUM),
    "tflops": re.compile(r"\btflops:\s*" + _NUM),
    "mfu": re.compile(r"\bmfu:\s*" + _NUM + r"%?"),
}

_MEGATRON_STEP_RE = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|")
_MEGATRON_FIELDS = {
    "step_time_ms": re.compile(r"elapsed time per iteration \(ms\):\s*" + _NUM),
    "tflops": re.compile(r"throughput per GPU \(TFLOP/s/GPU\):\s*" + _NUM),
    "loss": re.compile(r"\blm loss:\s*" + _NUM),
    "global_batch": re.compile(r"global batch size:\s*" + _NUM),
}
_MEGATRON_MEM_RE = re.compile(r"memory \(MB\).*?\|\s*max reserved:\s*" + _NUM)


def _number(text: str | None) -> float | None:
    if text is None or text == "N/A":
        return None
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _search(pattern: re.Pattern, line: str) -> float | None:
    m = pattern.search(line)
    return _number(m.group(1)) if m else None


def _empty_sample(step: int) -> dict:
    return {"step": step, **{key: None for key in METRIC_KEYS}}


def parse_titan_line(line: str, tokens_per_step: float | None = None) -> dict | None:
    """The sample of one torchtitan step line, or None."""
    line = _ANSI_RE.sub("", line)
    m = _TITAN_STEP_RE.search(line)
    if not m:
        return None
    sample = _empty_sample(int(m.group(1)))
    for key, pattern in _TITAN_FIELDS.items():
        sample[key] = _search(pattern, line)
    if sample["mfu"] is not None:
        sample["mfu"] /= 100.0  # torchtitan prints percent; the contract holds a fraction
    if tokens_per_step and sample["tokens_per_s"]:
        sample["step_time_s"] = tokens_per_step / sample["tokens_per_s"]
    return sample


def parse_megatron_line(line: str, seq_length: int | None = None) -> dict | None:
    """The sample of one Megatron-LM iteration line, or None (memory lines: see parse_lines)."""
    line = _ANSI_RE.sub("", line)
    m = _MEGATRON_STEP_RE.search(line)
    if not m:
        return None
    sample = _empty_sample(int(m.group(1)))
    sample["max_steps"] = int(m.group(2))
    step_time_ms = _search(_MEGATRON_FIELDS["step_time_ms"], line)
    sample["step_time_s"] = None if step_time_ms is None else step_time_ms / 1000.0
    sample["tflops"] = _search(_MEGATRON_FIELDS["tflops"], line)
    sample["loss"] = _search(_MEGATRON_FIELDS["loss"], line)
    global_batch = _search(_MEGATRON_FIELDS["global_batch"], line)
    if seq_length and global_batch and sample["step_time_s"]:
        sample["tokens_per_s"] = global_batch * seq_length / sample["step_time_s"]
    return sample


def _parse_contract(lines: Iterable[str]) -> list[dict]:
    return [s for s in map(parse_step, lines) if s is not None]


def _parse_titan(lines: Iterable[str], tokens_per_step: float | None) -> list[dict]:
    samples = (parse_titan_line(line, tokens_per_step) for line in lines)
    return [s for s in samples if s is not None]


def _parse_megatron(lines: list[str], seq_length: int | None) -> list[dict]:
    samples = [s for s in (parse_megatron_line(x, seq_length) for x in lines) if s is not None]
    reserved_mb = [v for v in (_search(_MEGATRON_MEM_RE, x) for x in lines) if v is not None]
    if reserved_mb:
        # A run-level peak: the report comes once, not per step, so every step carries it.
        peak_gib = max(reserved_mb) / 1024.0
        for sample in samples:
            sample["peak_mem_gib"] = peak_gib
    return samples


def _last_per_step(samples: list[dict]) -> list[dict]:
    """One sample per step (the last printed), in step order: a log may repeat a line."""
    by_step = {s["step"]: s for s in samples}
    return [by_step[k] for k in sorted(by_step)]


def parse_lines(
    lines: Iterable[str],
    fmt: str = "auto",
    *,
    seq_length: int | None = None,
    tokens_per_step: float | None = None,
) -> tuple[list[dict], str]:
    """(samples, format used). `auto` takes the format that yields the most steps."""
    lines = list(lines)
    parsers = {
        "contract": lambda: _parse_contract(lines),
        "titan": lambda: _parse_titan(lines, tokens_per_step),
        "megatron": lambda: _parse_megatron(lines, seq_length),
    }
    if fmt != "auto":
        if fmt not in parsers:
            raise ValueError(f"unknown log format {fmt!r}: choose auto, {', '.join(FORMATS)}")
        return _last_per_step(parsers[fmt]()), fmt
    best: tuple[list[dict], str] = ([], "contract")
    for name in FORMATS:  # contract first: it wins ties
        samples = parsers[name]()
        if len(samples) > len(best[0]):
            best = (samples, name)
    return _last_per_step(best[0]), best[1]


def parse_log(path: Path | str, fmt: str = "auto", **options) -> tuple[list[dict], str, dict]:
    """(samples, format used, environment from the contract's env line or {})."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    samples, used = parse_lines(lines, fmt, **options)
    env = next((e for e in map(parse_env, lines) if e is not None), {})
    return samples, used, env
