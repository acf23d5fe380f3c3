"""trainer.log_format=<a regular expression>: a user's own step lines, read by named groups."""

from __future__ import annotations

import re

from moe_perf.logs.base import LogFormat
from moe_perf.logs.lines import GIB_PER_UNIT, number, timestamp

# Named groups a user's regex may use: `step`, and step time or tokens/s, the rest optional.
REGEX_GROUPS = (
    "step",
    "max_steps",
    "step_time_s",
    "step_time_ms",
    "tokens_per_s",
    "tokens_per_s_device",
    "memory",
    "memory_unit",
    "loss",
    "tflops",
    "mfu",
)
REGEX_TIMING = ("step_time_s", "step_time_ms", "tokens_per_s", "tokens_per_s_device")


class RegexFormat(LogFormat):
    """A user's format: a regex with named groups from REGEX_GROUPS (`memory_unit`: GiB, GB, MiB,
    MB; GiB when the group is absent; MB and GB are decimal). Raises ValueError for a spec that
    is no regular expression or lacks the groups a step needs."""

    def __init__(self, spec: str):
        self.name = spec
        try:
            self.pattern = re.compile(spec)
        except re.error as err:
            raise ValueError(f"log format {spec!r} is not a regular expression ({err})") from None
        groups = set(self.pattern.groupindex)
        unknown = sorted(groups - set(REGEX_GROUPS))
        if unknown:
            raise ValueError(
                f"log format regex: unknown group(s) {', '.join(unknown)}; "
                f"named groups are {', '.join(REGEX_GROUPS)}"
            )
        if "step" not in groups or not groups & set(REGEX_TIMING):
            raise ValueError(
                f"log format regex needs (?P<step>...) and one of "
                f"{', '.join(f'(?P<{g}>...)' for g in REGEX_TIMING)}"
            )

    def describe(self) -> str:
        return f"log format regex {self.name!r}"

    def parse(self, text: str) -> dict | None:
        match = self.pattern.search(text)
        if not match:
            return None
        values = match.groupdict()
        try:
            step = int(values["step"])
        except (TypeError, ValueError):
            return None
        raw = {"step": step, "timestamp": timestamp(text)}
        if values.get("max_steps"):
            raw["max_steps"] = int(values["max_steps"])
        for key in ("step_time_s", "tokens_per_s", "tokens_per_s_device", "loss", "tflops", "mfu"):
            raw[key] = number(values.get(key))
        ms = number(values.get("step_time_ms"))
        if raw["step_time_s"] is None and ms is not None:
            raw["step_time_s"] = ms / 1000.0
        memory = number(values.get("memory"))
        unit = (values.get("memory_unit") or "GiB").strip().lower()
        if memory is not None and unit in GIB_PER_UNIT:
            raw["peak_mem_gib"] = memory * GIB_PER_UNIT[unit]
        return raw
