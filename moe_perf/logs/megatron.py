"""trainer.log_format=megatron and nemo, and their memory reports.

* megatron: ` [2024-04-06 02:59:36] iteration  43/ 100 | consumed samples: ... | elapsed time
  per iteration (ms): 5444.9 | throughput per GPU (TFLOP/s/GPU): 239.8 | ... | global batch
  size: 128 | lm loss: ... | number of skipped iterations: 0 |` from the last pipeline rank;
  memory in separate `[Rank r] (after k iterations) memory (MB) | ... | max reserved: ...`
  reports (MiB; Megatron-Bridge: `memory (GB) | mem-max-reserved-gigabytes: ...`, decimal GB).
  A skipped iteration (fp16 loss-scale overflow) did no update and is not counted.
* nemo (NeMo 2.0's progress printer): `Training epoch 0, iteration 8/29 | lr: ... |
  global_batch_size: 128 | global_step: 8 | reduced_train_loss: ... | train_step_timing in s:
  26.93`, memory as Megatron-Bridge's GB report. Not a Megatron line, though both say
  "iteration k/N |": a Megatron line goes on with `consumed samples:`.
"""

from __future__ import annotations

import re

from moe_perf.logs.base import LogFormat
from moe_perf.logs.lines import GIB_PER_UNIT, NUM, number, search, timestamp
from moe_perf.logs.steps import positive

_MEGATRON_STEP_RE = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|\s*consumed samples:")
_MEGATRON_FIELDS = {
    "step_time_ms": re.compile(r"elapsed time per iteration \(ms\):\s*" + NUM),
    "tflops": re.compile(r"throughput per GPU \(TFLOP/s/GPU\):\s*" + NUM),
    "loss": re.compile(r"\blm loss:\s*" + NUM),
    "global_batch": re.compile(r"global batch size:\s*" + NUM),
    "skipped": re.compile(r"number of skipped iterations:\s*" + NUM),
}
_MEMORY_MIB_RE = re.compile(r"memory \(MB\).*?\|\s*max reserved:\s*" + NUM)
_MEMORY_GB_RE = re.compile(r"mem-max-reserved-gigabytes:\s*" + NUM)
_MAX_ALLOCATED_MIB_RE = re.compile(r"memory \(MB\).*?\|\s*max allocated:\s*" + NUM)

_NEMO_STEP_RE = re.compile(r"\bTraining epoch\s+\d+,\s*iteration\s+(\d+)\s*/\s*(\d+)")
_NEMO_FIELD_RE = re.compile(r"\|\s*([^|:]+?)\s*:\s*([^|\s]+)")


def memory_gib(text: str) -> float | None:
    """Peak reserved memory (GiB) of a Megatron (MiB) or Megatron-Bridge (GB) memory report."""
    mib = search(_MEMORY_MIB_RE, text)
    if mib is not None:
        return mib / 1024.0
    gb = search(_MEMORY_GB_RE, text)
    return None if gb is None else gb * GIB_PER_UNIT["gb"]


def allocated_and_reserved_gib(text: str) -> tuple[float, float] | None:
    """(max allocated, max reserved) GiB of a Megatron memory report (MiB) that has both, or
    None: `[Rank r] (after k iterations) memory (MB) | allocated: ... | max allocated: ... |
    reserved: ... | max reserved: ...`."""
    allocated, reserved = search(_MAX_ALLOCATED_MIB_RE, text), search(_MEMORY_MIB_RE, text)
    if allocated is None or reserved is None:
        return None
    return allocated / 1024.0, reserved / 1024.0


class _MemoryReports(LogFormat):
    """A format whose memory is in reports of their own, not on the step lines: the largest
    report of the run is every step's peak."""

    def __init__(self) -> None:
        self._memory: list[float] = []

    def other_line(self, who: tuple | None, text: str) -> None:
        gib = memory_gib(text)
        if gib is not None:
            self._memory.append(gib)

    def peak_memory(self) -> float | None:
        return max(self._memory) if self._memory else None


class MegatronFormat(_MemoryReports):
    name = "megatron"
    first_words = "iteration k/ N | consumed samples: ..."

    def parse(self, text: str) -> dict | None:
        match = _MEGATRON_STEP_RE.search(text)
        if not match:
            return None
        raw = {
            "step": int(match.group(1)),
            "max_steps": int(match.group(2)),
            "timestamp": timestamp(text),
        }
        for key, pattern in _MEGATRON_FIELDS.items():
            raw[key] = search(pattern, text)
        ms = raw.pop("step_time_ms")
        raw["step_time_s"] = None if ms is None else ms / 1000.0
        return raw

    def correct(self, combined: list[dict]) -> list[str]:
        """Megatron-LM (main of 2026-08, d98e8a6) prints iteration 1 without resetting its
        interval timer, so its next line's time per iteration is the mean over iterations 1..k,
        step 1's start-up included: on an H200, step 2 printed 2226 ms, 914 ms by the two lines'
        timestamps, with step 1 at 3538 ms. Where the timestamps say so (the printed time within
        2% of that mean, and more than 25% off the timestamps' own time per step), the step gets
        its own time back, (k*t_k - t_1) / (k - 1), and its TFLOP/s (printed from the same
        mean) with it. Megatron-LM versions that reset the timer after iteration 1 print the
        timestamps' time and are left as printed."""
        if len(combined) < 2 or combined[0]["step"] != 1:
            return []
        first, cur = combined[0], combined[1]
        t1, printed, k = first["step_time_s"], cur["step_time_s"], cur["step"]
        if None in (t1, printed, first["timestamp"], cur["timestamp"]):
            return []
        by_timestamps = (cur["timestamp"] - first["timestamp"]) / (k - 1)
        mean_with_step1 = (t1 + by_timestamps * (k - 1)) / k
        # only where the two readings are far apart: the lines' millisecond timestamps jitter by
        # a few percent of a short step, and a step 1 as fast as step 2 leaves nothing to undo
        if (
            abs(printed - mean_with_step1) > 0.02 * printed
            or abs(printed - by_timestamps) <= 0.25 * by_timestamps
        ):
            return []
        own = positive((k * printed - t1) / (k - 1))
        if own is None:
            return []
        cur["step_time_s"] = own
        if cur["tflops"] is not None:
            cur["tflops"] = cur["tflops"] * printed / own
        return [
            f"step {k}: Megatron printed the mean over iterations 1-{k} (its interval timer "
            f"is not reset after iteration 1, as the lines' timestamps show); step {k}'s own "
            f"time is ({k} x printed - step 1's) / {k - 1}, its TFLOP/s scaled to match"
        ]


class NemoFormat(_MemoryReports):
    name = "nemo"
    first_words = "Training epoch e, iteration k/N | ..."

    def __init__(self) -> None:
        super().__init__()
        self._offset: int | None = None

    def parse(self, text: str) -> dict | None:
        """`step` is the iteration as printed (0-based in NeMo 2.0 releases that print
        `global_step`; `step` numbers them from 1)."""
        match = _NEMO_STEP_RE.search(text)
        if not match:
            return None
        fields = {k.strip().lower(): v for k, v in _NEMO_FIELD_RE.findall(text[match.end() :])}
        tflops = next((v for k, v in fields.items() if k.startswith("tflops")), None)
        global_step = number(fields.get("global_step"))
        return {
            "step": int(match.group(1)),
            "max_steps": int(match.group(2)),
            "global_step": None if global_step is None else int(global_step),
            "timestamp": timestamp(text),
            "step_time_s": number(fields.get("train_step_timing in s")),
            "global_batch": number(fields.get("global_batch_size")),
            "loss": number(fields.get("reduced_train_loss")),
            "tflops": number(tflops),
        }

    def step(self, raw: dict) -> int:
        # NeMo's global_step counts from 0; so does `iteration` in the releases that print it
        if raw.get("global_step") is not None:
            return raw["global_step"] + 1
        if self._offset is None:
            self._offset = 1 if raw["step"] == 0 else 0
        return raw["step"] + self._offset
