"""trainer.log_format=torchtitan: `step: 2  loss: 6.09  grad_norm: 4.2  memory: 4.26GiB(2.39%)
tps: 72,915  tflops: 39.59  mfu: 38.1%`, after a `[titan] 2026-07-17 12:05:19,496 - root -
INFO - ` logger prefix. Before mid-2024 `wps:` instead of `tps:` and no tflops; 0.3 colours
every field (copied logs often lose the ESC byte: `[31mstep:`).

`tps` is PER DEVICE: local tokens / (time x cp x tp x pp), the local tokens counted before the
CP split, so global tokens/s = tps x world. No step time is printed: it is global_batch x seq /
world / tps where the shape is known, else the difference of two lines' timestamps. `memory`
is the peak reserved since the last log line; `tflops: 0.00` / `mfu: N/A` mean not computed.
`validate step:` lines are evaluation and never a training step. Any rank may print its own
line.
"""

from __future__ import annotations

import re

from moe_perf.logs.base import LogFormat
from moe_perf.logs.lines import NUM, search, timestamp
from moe_perf.logs.steps import RunShape, positive

_STEP_RE = re.compile(r"\bstep:\s*(\d+)\s+loss:")
_VALIDATE_RE = re.compile(r"\bvalidate step:")
_FIELDS = {
    "loss": re.compile(r"\bloss:\s*" + NUM),
    "peak_mem_gib": re.compile(r"\bmemory:\s*" + NUM + r"\s*GiB"),
    "tokens_per_s_device": re.compile(r"\b[tw]ps:\s*" + NUM),
    "tflops": re.compile(r"\btflops:\s*" + NUM),
    "mfu": re.compile(r"\bmfu:\s*" + NUM),
}


class TorchtitanFormat(LogFormat):
    """Where both the shape and the lines' stamps are known, a rank's rate that disagrees with
    its own stamps is a problem (`check`)."""

    name = "torchtitan"
    first_words = "step: k  loss: ..."

    def __init__(self) -> None:
        self._validation_lines = 0
        self._clock: dict = {}  # per rank (and node): [timestamp, step] of its last reset
        self._clock_off, self._clock_problem = 0, 0  # steps whose rate and stamps disagree

    def parse(self, text: str) -> dict | None:
        if _VALIDATE_RE.search(text):
            return None
        match = _STEP_RE.search(text)
        if not match:
            return None
        raw = {"step": int(match.group(1)), "timestamp": timestamp(text)}
        for key, pattern in _FIELDS.items():
            raw[key] = search(pattern, text)
        if raw["mfu"] is not None:
            raw["mfu"] /= 100.0  # printed in percent; the contract holds a fraction
        return raw

    def other_line(self, who: tuple | None, text: str) -> None:
        if _VALIDATE_RE.search(text):
            self._validation_lines += 1
            if who in self._clock:  # validation resets torchtitan's clock: the next step's
                self._clock[who][0] = timestamp(text)  # rate leaves it out

    def notes(self) -> list[str]:
        if not self._validation_lines:
            return []
        return [f"{self._validation_lines} `validate step:` line(s) ignored (evaluation)"]

    def check(self, who: tuple | None, raw: dict, shape: RunShape, problems: list[str]) -> None:
        """torchtitan prints tokens/s per device, not its step time, so the time read from it
        rests on the run's shape (tokens per step, ranks). Its logger also stamps each line as
        the rate is computed: the time since the rank's last line that reset its clock (a step
        or a validation) is a second reading of the same interval. Off by more than a quarter
        (and 50 ms: the stamps are to the millisecond, and its metric logging falls between
        them), the shape is not what the trainer ran, or the line is damaged: a problem."""
        if who is None and shape.world_size != 1:
            return  # without rank prefixes, whose line came before is unknown
        stamp, tps = raw["timestamp"], positive(raw["tokens_per_s_device"])
        last = self._clock.get(who)
        if last is not None and raw["step"] <= last[1]:
            return  # a repeat, or out of order: the reader's order check judges it
        self._clock[who] = [stamp, raw["step"]]
        tokens, world = shape.tokens_per_step(raw.get("global_batch")), shape.world_size
        if None in (last, stamp, tps, tokens, world) or last[0] is None:
            return
        from_tps = tokens / world / tps * (raw["step"] - last[1])
        between = stamp - last[0]
        if abs(from_tps - between) > max(0.25 * between, 0.05):
            said = (f"step {raw['step']}: tps {tps:,.0f} per device means {from_tps:.3f} s for "
                    f"{tokens:g} tokens over {world:g} rank{'s' if world != 1 else ''}, but the "
                    f"log's own stamps say {between:.3f} s")  # fmt: skip
            self._clock_disagrees(said, problems)

    def _clock_disagrees(self, said: str, problems: list[str]) -> None:
        self._clock_off += 1
        if self._clock_off > 1:  # the first one says it; the others are counted
            more = self._clock_off - 1
            first = problems[self._clock_problem].split(" (and ")[0]
            problems[self._clock_problem] = (
                f"{first} (and {more} more such step{'s' if more > 1 else ''})"
            )
            return
        self._clock_problem = len(problems)
        problems.append(
            f"{said}: the trainer does not run the shape it was given (training.global_batch, "
            f"training.sequence_length, mesh), or the line is damaged"
        )
