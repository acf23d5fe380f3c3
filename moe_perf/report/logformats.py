"""Per-step samples from a trainer's console output, in every format moe_perf reads, brought to
the contract's meaning before anything is recorded or compared.

A format is one of `FORMATS` or a regular expression with named groups (`REGEX_GROUPS`). What
each framework prints (read in its own source) and what it leaves out:

* contract: `[moe_perf] step=k/N step_time_s=... tokens_per_s=... peak_mem_gib=...`, global
  tokens/s, from one rank (docs/trainer-contract.md). Taken as printed, rank 0 only.
* torchtitan: `step: 2  loss: 6.09  grad_norm: 4.2  memory: 4.26GiB(2.39%)  tps: 72,915
  tflops: 39.59  mfu: 38.1%`, after a `[titan] 2026-07-17 12:05:19,496 - root - INFO - ` logger
  prefix. Before mid-2024 `wps:` instead of `tps:` and no tflops; 0.3 colours every field
  (copied logs often lose the ESC byte: `[31mstep:`). `tps` is PER DEVICE: local tokens /
  (time x cp x tp x pp), the local tokens counted before the CP split, so global tokens/s =
  tps x world. No step time is printed: it is global_batch x seq / world / tps where the shape
  is known, else the difference of two lines' timestamps. Where both are known, a rank's rate
  that disagrees with its own stamps is a problem (`LogReader._check_clock`). `memory` is the
  peak reserved since the last log line; `tflops: 0.00` / `mfu: N/A` mean not computed.
  `validate step:` lines are evaluation and never a training step. Any rank may print its own
  line.
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

Normalization: time per optimizer step; tokens/s global (global batch x sequence length / step
time where the shape is known); a step printed by several ranks is one step, with the slowest
rank's time and the largest memory; values averaged over a log interval longer than one step
are flagged (`interval_steps`); non-finite or negative values and 0 TFLOP/s or MFU are unknown
(None). `ParsedLog.derivations` says, in words, what was derived and how. Pure Python.

Validation, before a line counts: a step time or tokens/s that is printed but not a positive
finite number, a step beyond the line's own `/N`, a step printed after a later one, or a step
printed twice with different values by the same rank is a `problem`: the log cannot stand as a
result (`ParsedLog.failure`). The same line printed twice is dropped with a note. Before any of
this, a line torchrun --tee passed on in two pieces is made whole again (`TeeLines`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from moe_perf.common.contract import parse_env, parse_step

FORMATS = ("contract", "torchtitan", "megatron", "nemo")
# how each format's step line begins, for a message that says what was looked for
FORMAT_LINES = {
    "contract": "[moe_perf] step=k/N ...",
    "torchtitan": "step: k  loss: ...",
    "megatron": "iteration k/ N | consumed samples: ...",
    "nemo": "Training epoch e, iteration k/N | ...",
}
METRIC_KEYS = ("step_time_s", "tokens_per_s", "peak_mem_gib", "loss", "tflops", "mfu")
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
_GIB_PER_UNIT = {
    "gib": 1.0,
    "gb": 1e9 / 2**30,
    "mib": 1 / 1024,
    "mb": 1e6 / 2**30,
    "kib": 1 / 2**20,
    "kb": 1e3 / 2**30,
    "b": 1 / 2**30,
}

# ---- one line --------------------------------------------------------------------------------

# Colour codes, with their ESC byte or without it (a copy-pasted log): `[31m`, `[38;2;54;234;195m`.
# Without ESC at least one digit is required, so `[moe_perf]` is not mistaken for one.
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m|\[\d[0-9;]*m")
# `srun --label` puts `N: ` first; torchrun --tee puts `[rankN]:` or `[defaultN]:`.
_PREFIX_RE = re.compile(r"^\s*(?:\d+:\s)?\s*(?:\[(?:rank|default)(\d+)\]:)?")
_NUM = r"([-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf)|N/A)"
_TIMESTAMP_RE = re.compile(r"(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:[,.](\d{1,6}))?")

_TITAN_STEP_RE = re.compile(r"\bstep:\s*(\d+)\s+loss:")
_TITAN_VALIDATE_RE = re.compile(r"\bvalidate step:")
_TITAN_FIELDS = {
    "loss": re.compile(r"\bloss:\s*" + _NUM),
    "peak_mem_gib": re.compile(r"\bmemory:\s*" + _NUM + r"\s*GiB"),
    "tokens_per_s_device": re.compile(r"\b[tw]ps:\s*" + _NUM),
    "tflops": re.compile(r"\btflops:\s*" + _NUM),
    "mfu": re.compile(r"\bmfu:\s*" + _NUM),
}

_MEGATRON_STEP_RE = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|\s*consumed samples:")
_MEGATRON_FIELDS = {
    "step_time_ms": re.compile(r"elapsed time per iteration \(ms\):\s*" + _NUM),
    "tflops": re.compile(r"throughput per GPU \(TFLOP/s/GPU\):\s*" + _NUM),
    "loss": re.compile(r"\blm loss:\s*" + _NUM),
    "global_batch": re.compile(r"global batch size:\s*" + _NUM),
    "skipped": re.compile(r"number of skipped iterations:\s*" + _NUM),
}
_MEMORY_MIB_RE = re.compile(r"memory \(MB\).*?\|\s*max reserved:\s*" + _NUM)
_MEMORY_GB_RE = re.compile(r"mem-max-reserved-gigabytes:\s*" + _NUM)

_NEMO_STEP_RE = re.compile(r"\bTraining epoch\s+\d+,\s*iteration\s+(\d+)\s*/\s*(\d+)")
_NEMO_FIELD_RE = re.compile(r"\|\s*([^|:]+?)\s*:\s*([^|\s]+)")


def clean(line: str) -> tuple[int | None, str]:
    """(torchrun local rank or None, the line without colour codes and launcher prefixes)."""
    text = _ANSI_RE.sub("", line.rstrip("\r\n"))
    match = _PREFIX_RE.match(text)
    rank = int(match.group(1)) if match.group(1) is not None else None
    return rank, text[match.end() :]


# torchrun's own prefix anywhere in a line; `srun --label` comes only first.
_TEE_PREFIX_RE = re.compile(r"\[(?:rank|default)\d+\]:")
_SRUN_LABEL_RE = re.compile(r"^\s*\d+:\s")


class TeeLines:
    """Whole lines back from torchrun --tee's stdout. torchrun copies each rank's log file with
    readline(), which at the end of a file returns what is written so far; so a line can come
    in two pieces, each with the rank's prefix and no newline after the first, other ranks'
    lines glued on in between: `[rank1]:...step:  6 ...tps: 3,1[rank0]:...step:  6 ...` then
    `[rank1]:90  tflops: ...`. Read as lines, both would be rank 1's step 6 with other values
    (seen once in CI), or a cut number a wrong figure. `split` gives each whole line once, with
    its prefix; `rest` the pieces a stream ended on. A prefix right after another is a rank's
    text (torch's C++ warnings start `[rank0]:`), never a cut: readline never returns ""."""

    def __init__(self) -> None:
        self._pending: dict[str, str] = {}  # srun label + prefix -> the line so far

    def split(self, line: str) -> list[str]:
        line = line.rstrip("\n")
        label = _SRUN_LABEL_RE.match(line)
        label = label.group(0) if label else ""
        pieces, key, start = [], None, len(label)  # (prefix or None, text) in arrival order
        for cut in _TEE_PREFIX_RE.finditer(line, len(label)):
            if cut.start() == start and key is not None:
                continue  # right after a prefix: the rank's own text
            if cut.start() > start or key is not None:
                pieces.append((key, line[start : cut.start()]))
            key, start = label + cut.group(0), cut.end()
        pieces.append((key, line[start:]))
        whole = []
        for i, (key, text) in enumerate(pieces):
            if key is None:  # before any prefix: torchrun's own words, or not torchrun's
                whole.append(label + text)
                continue
            text = self._pending.pop(key, "") + text
            if i < len(pieces) - 1:
                self._pending[key] = text  # no newline after it: the line goes on later
            else:
                whole.append(key + text)
        return whole

    def rest(self) -> list[str]:
        """The pieces no newline ever ended (a rank killed mid-line)."""
        rest = [key + text for key, text in self._pending.items()]
        self._pending.clear()
        return rest


def _number(text: str | None) -> float | None:
    if text is None or text == "N/A":
        return None
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _search(pattern: re.Pattern, text: str) -> float | None:
    match = pattern.search(text)
    return _number(match.group(1)) if match else None


def _timestamp(text: str) -> float | None:
    """Seconds of the line's `YYYY-MM-DD HH:MM:SS[,mmm]` timestamp (for differences only)."""
    match = _TIMESTAMP_RE.search(text)
    if not match:
        return None
    day, clock, fraction = match.groups()
    try:
        when = datetime.strptime(f"{day} {clock}", "%Y-%m-%d %H:%M:%S")
    except ValueError:
        return None
    return when.timestamp() + (float(f"0.{fraction}") if fraction else 0.0)


def memory_gib(text: str) -> float | None:
    """Peak reserved memory (GiB) of a Megatron (MiB) or Megatron-Bridge (GB) memory report."""
    mib = _search(_MEMORY_MIB_RE, text)
    if mib is not None:
        return mib / 1024.0
    gb = _search(_MEMORY_GB_RE, text)
    return None if gb is None else gb * _GIB_PER_UNIT["gb"]


def torchtitan_line(text: str) -> dict | None:
    if _TITAN_VALIDATE_RE.search(text):
        return None
    match = _TITAN_STEP_RE.search(text)
    if not match:
        return None
    raw = {"step": int(match.group(1)), "timestamp": _timestamp(text)}
    for key, pattern in _TITAN_FIELDS.items():
        raw[key] = _search(pattern, text)
    if raw["mfu"] is not None:
        raw["mfu"] /= 100.0  # printed in percent; the contract holds a fraction
    return raw


def megatron_line(text: str) -> dict | None:
    match = _MEGATRON_STEP_RE.search(text)
    if not match:
        return None
    raw = {
        "step": int(match.group(1)),
        "max_steps": int(match.group(2)),
        "timestamp": _timestamp(text),
    }
    for key, pattern in _MEGATRON_FIELDS.items():
        raw[key] = _search(pattern, text)
    ms = raw.pop("step_time_ms")
    raw["step_time_s"] = None if ms is None else ms / 1000.0
    return raw


def nemo_line(text: str) -> dict | None:
    """A NeMo progress line; `step` is the iteration as printed (0-based in NeMo 2.0 releases
    that print `global_step`; `_NemoSteps` numbers them from 1)."""
    match = _NEMO_STEP_RE.search(text)
    if not match:
        return None
    fields = {k.strip().lower(): v for k, v in _NEMO_FIELD_RE.findall(text[match.end() :])}
    tflops = next((v for k, v in fields.items() if k.startswith("tflops")), None)
    global_step = _number(fields.get("global_step"))
    return {
        "step": int(match.group(1)),
        "max_steps": int(match.group(2)),
        "global_step": None if global_step is None else int(global_step),
        "timestamp": _timestamp(text),
        "step_time_s": _number(fields.get("train_step_timing in s")),
        "global_batch": _number(fields.get("global_batch_size")),
        "loss": _number(fields.get("reduced_train_loss")),
        "tflops": _number(tflops),
    }


def contract_line(text: str) -> dict | None:
    return parse_step(text)


class RegexFormat:
    """A user's format: a regex with named groups from REGEX_GROUPS (`memory_unit`: GiB, GB, MiB,
    MB; GiB when the group is absent; MB and GB are decimal)."""

    def __init__(self, spec: str):
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

    def __call__(self, text: str) -> dict | None:
        match = self.pattern.search(text)
        if not match:
            return None
        values = match.groupdict()
        try:
            step = int(values["step"])
        except (TypeError, ValueError):
            return None
        raw = {"step": step, "timestamp": _timestamp(text)}
        if values.get("max_steps"):
            raw["max_steps"] = int(values["max_steps"])
        for key in ("step_time_s", "tokens_per_s", "tokens_per_s_device", "loss", "tflops", "mfu"):
            raw[key] = _number(values.get(key))
        ms = _number(values.get("step_time_ms"))
        if raw["step_time_s"] is None and ms is not None:
            raw["step_time_s"] = ms / 1000.0
        memory = _number(values.get("memory"))
        unit = (values.get("memory_unit") or "GiB").strip().lower()
        if memory is not None and unit in _GIB_PER_UNIT:
            raw["peak_mem_gib"] = memory * _GIB_PER_UNIT[unit]
        return raw


def line_parser(log_format: str):
    """The function reading one cleaned line of this format into a raw step dict, or None.
    Raises ValueError for a format that is neither a known name nor a usable regex."""
    named = {
        "contract": contract_line,
        "torchtitan": torchtitan_line,
        "megatron": megatron_line,
        "nemo": nemo_line,
    }
    if log_format in named:
        return named[log_format]
    return RegexFormat(log_format)


class UnknownFormat(ValueError):
    """No line of any format moe_perf knows: the message lists what was looked for."""

    def __init__(self, source: str) -> None:
        tried = ", ".join(f"{name} `{FORMAT_LINES[name]}`" for name in FORMATS)
        super().__init__(f"{source}: no step line of a format moe_perf knows (tried: {tried})")


def detect_format(lines: Iterable[str]) -> str | None:
    """The format whose step lines are most numerous in these lines (contract wins ties)."""
    counts = dict.fromkeys(FORMATS, 0)
    parsers = {name: line_parser(name) for name in FORMATS}
    for line in lines:
        _, text = clean(line)
        for name, parse in parsers.items():
            if parse(text) is not None:
                counts[name] += 1
    best = max(FORMATS, key=lambda name: counts[name])  # first of the maxima: contract first
    return best if counts[best] else None


# ---- steps -----------------------------------------------------------------------------------


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


def _known(value: float | None) -> float | None:
    """Non-finite and negative values are unknown, never results."""
    if value is None or not math.isfinite(value) or value < 0:
        return None
    return value


def _finite(value: float | None) -> float | None:
    """A loss may be negative (a user's objective, a log-likelihood); only nan and inf are
    unknown."""
    return value if value is not None and math.isfinite(value) else None


def _positive(value: float | None) -> float | None:
    """0 TFLOP/s, 0 MFU, a 0 s step: not computed, so unknown."""
    value = _known(value)
    return value if value else None


# what a figure may be, where it is not `_known` (finite and non-negative)
_VALUE_RULES = {"tflops": _positive, "mfu": _positive, "loss": _finite}


def _values(raw: dict) -> dict:
    """A step line's figures, for telling a repeated line from a different one."""
    return {k: v for k, v in raw.items() if k != "timestamp"}


def _combine(raws: list[dict]) -> dict:
    """One step printed by several ranks (or repeated): the slowest rank's time and throughput,
    the largest memory, the first loss that is a loss (non-last pipeline stages print none)."""

    def pick(key, choose):
        rule = _finite if key == "loss" else _known
        values = [v for v in (rule(r.get(key)) for r in raws) if v is not None]
        return choose(values) if values else None

    first = raws[0]
    return {
        "step": first["step"],
        "max_steps": first.get("max_steps"),
        "timestamp": pick("timestamp", max),
        "step_time_s": _positive(pick("step_time_s", max)),
        "tokens_per_s": _positive(pick("tokens_per_s", min)),
        "tokens_per_s_device": _positive(pick("tokens_per_s_device", min)),
        "peak_mem_gib": pick("peak_mem_gib", max),
        "loss": pick("loss", lambda v: v[0]),
        "tflops": _positive(pick("tflops", min)),
        "mfu": _positive(pick("mfu", min)),
        "global_batch": pick("global_batch", lambda v: v[0]),
        "skipped": pick("skipped", max),
        "ranks": len(raws),
    }


def _undo_megatron_first_average(combined: list[dict], used: set[str]) -> None:
    """Megatron-LM (main of 2026-08, d98e8a6) prints iteration 1 without resetting its interval
    timer, so its next line's time per iteration is the mean over iterations 1..k, step 1's
    start-up included: on an H200, step 2 printed 2226 ms, 914 ms by the two lines' timestamps,
    with step 1 at 3538 ms. Where the timestamps say so (the printed time within 2% of that mean,
    and more than 25% off the timestamps' own time per step), the step gets its own time back,
    (k*t_k - t_1) / (k - 1), and its TFLOP/s (printed from the same mean) with it. Megatron-LM
    versions that reset the timer after iteration 1 print the timestamps' time and are left as
    printed."""
    if len(combined) < 2 or combined[0]["step"] != 1:
        return
    first, cur = combined[0], combined[1]
    t1, printed, k = first["step_time_s"], cur["step_time_s"], cur["step"]
    if None in (t1, printed, first["timestamp"], cur["timestamp"]):
        return
    by_timestamps = (cur["timestamp"] - first["timestamp"]) / (k - 1)
    mean_with_step1 = (t1 + by_timestamps * (k - 1)) / k
    near = 0.02 * printed
    # only where the two readings are far apart: the lines' millisecond timestamps jitter by a
    # few percent of a short step, and a step 1 as fast as step 2 leaves nothing to undo
    if (
        abs(printed - mean_with_step1) > near
        or abs(printed - by_timestamps) <= 0.25 * by_timestamps
    ):
        return
    own = _positive((k * printed - t1) / (k - 1))
    if own is None:
        return
    cur["step_time_s"] = own
    if cur["tflops"] is not None:
        cur["tflops"] = cur["tflops"] * printed / own
    used.add("megatron_first_average")


@dataclass
class ParsedLog:
    log_format: str
    steps: list[dict]  # normalized samples (STEP keys, max_steps, interval_steps where > 1)
    derivations: list[str] = field(default_factory=list)
    env: dict | None = None
    skipped_steps: list[int] = field(default_factory=list)
    steps_reported: int = 0  # step numbers printed, skipped ones included
    problems: list[str] = field(default_factory=list)  # lines that make the log no result

    def failure(self, max_steps: int) -> str | None:
        """Why this log cannot stand as an arm's result, or None."""
        problems = list(self.problems)
        beyond = [s["step"] for s in self.steps if max_steps and s["step"] > max_steps]
        if beyond:
            problems.append(f"step {beyond[0]} is beyond training.max_steps={max_steps}")
        if problems:
            more = f" (and {len(problems) - 2} more)" if len(problems) > 2 else ""
            return (
                "bad step lines, so no figure of this run is used: "
                + "; ".join(problems[:2])
                + more
            )
        if not self.steps_reported:
            if self.log_format == "contract":
                return "no metrics: the trainer printed no '[moe_perf] step=' lines"
            return f"no metrics: the trainer printed no step lines of {self.describe()}"
        if not any(s.get("step_time_s") is not None for s in self.steps):
            return f"no step time in the trainer's {self.describe()} lines: " + "; ".join(
                self.derivations
            )
        if self.steps_reported < max_steps:
            return f"only {self.steps_reported} of {max_steps} steps reported"
        return None

    def describe(self) -> str:
        if self.log_format in FORMATS:
            return f"log format {self.log_format}"
        return f"log format regex {self.log_format!r}"


class LogReader:
    """Reads a trainer's output line by line (every rank's, prefixes included) in one format;
    `feed` gives a sample per new step for progress, `result()` the normalized steps."""

    def __init__(self, log_format: str, shape: RunShape | None = None):
        self.log_format = log_format
        self.shape = shape or RunShape()
        self._parse = line_parser(log_format)
        self._raws: dict[int, list[dict]] = {}
        self._memory: list[float] = []
        self._validation_lines = 0
        self._nemo_offset: int | None = None
        self._last: dict = {}  # per rank (and node): the last step line it printed
        self._clock: dict = {}  # per rank (and node): [timestamp, step] of torchtitan's
        self._clock_off, self._clock_problem = 0, 0  # steps whose rate and stamps disagree
        self._dropped_repeats: list[int] = []
        self.problems: list[str] = []
        self.env: dict | None = None
        self.step_line = False

    def feed(self, line: str) -> dict | None:
        """The sample to show for this line, or None; `step_line` says whether it was a step's
        line (a later rank's line of a step already shown gives None, but is one)."""
        rank, text = clean(line)
        if self.log_format == "contract":
            sample = self._feed_contract(rank, text)
            self.step_line = sample is not None
            return sample
        env = parse_env(text)
        if env is not None:
            self.env = env
        # who printed it: srun --label's task (the node) as well, where torchrun's prefix has
        # the local rank (its default; a log from another launch) and is the same on each node
        label = _SRUN_LABEL_RE.match(line)
        who = None if rank is None else (label.group(0).strip() if label else "", rank)
        raw = self._parse(text)
        self.step_line = raw is not None
        if raw is None:
            self._note_other(who, text)
            return None
        if self.log_format == "nemo":
            raw["step"] = self._nemo_step(raw)
        self._check_values(raw)
        if self.log_format == "torchtitan":
            self._check_clock(who, raw)
        if who is not None and not self._in_order(who, raw):
            return None  # without a rank prefix every rank's line looks alike: no order check
        new = raw["step"] not in self._raws
        self._raws.setdefault(raw["step"], []).append(raw)
        if not new:
            return None
        previous = max((k for k in self._raws if k < raw["step"]), default=None)
        prev = _combine(self._raws[previous]) if previous is not None else None
        return self._normalize(_combine([raw]), prev, set())

    def _feed_contract(self, rank: int | None, text: str) -> dict | None:
        if rank not in (None, 0):
            return None  # the contract is printed by one rank; others are console.log only
        sample = parse_step(text)
        if sample is None:
            env = parse_env(text)
            if env is not None:
                self.env = env
            return None
        if sample["step"] > sample["max_steps"]:
            self.problems.append(f"step {sample['step']} is beyond its own /{sample['max_steps']}")
        self._check_values(sample)
        if not self._in_order(rank, sample):
            return None
        for key in METRIC_KEYS:
            if key in sample:
                sample[key] = _VALUE_RULES.get(key, _known)(sample[key])
        self._raws[sample["step"]] = [sample]
        return sample

    def _check_values(self, raw: dict) -> None:
        """A step time or tokens/s printed as nan, inf, 0 or negative is a problem: the log
        is no result (an empty value is unknown, and fine)."""
        for key in ("step_time_s", "tokens_per_s", "tokens_per_s_device"):
            value = raw.get(key)
            if value is not None and not (math.isfinite(value) and value > 0):
                printed = f"step {raw['step']}: {key}={value:g}"
                self.problems.append(f"{printed} is not a positive number")

    def _in_order(self, who: object, raw: dict) -> bool:
        """Whether this rank's step line counts: a step going backwards or printed again with
        other values is a problem; the same line printed twice is dropped with a note."""
        step = raw["step"]
        last = self._last.get(who)
        self._last[who] = raw
        if last is None or step > last["step"]:
            return True
        if step < last["step"]:
            self.problems.append(f"step {step} printed after step {last['step']} (out of order)")
        elif _values(raw) == _values(last):
            self._dropped_repeats.append(step)
        else:
            self.problems.append(f"step {step} printed twice with different values")
        return False

    def _check_clock(self, who: tuple | None, raw: dict) -> None:
        """torchtitan prints tokens/s per device, not its step time, so the time read from it
        rests on the run's shape (tokens per step, ranks). Its logger also stamps each line as
        the rate is computed: the time since the rank's last line that reset its clock (a step
        or a validation) is a second reading of the same interval. Off by more than a quarter
        (and 50 ms: the stamps are to the millisecond, and its metric logging falls between
        them), the shape is not what the trainer ran, or the line is damaged: a problem."""
        if who is None and self.shape.world_size != 1:
            return  # without rank prefixes, whose line came before is unknown
        stamp, tps = raw["timestamp"], _positive(raw["tokens_per_s_device"])
        last = self._clock.get(who)
        if last is not None and raw["step"] <= last[1]:
            return  # a repeat, or out of order: _in_order's to judge
        self._clock[who] = [stamp, raw["step"]]
        tokens, world = self.shape.tokens_per_step(raw.get("global_batch")), self.shape.world_size
        if None in (last, stamp, tps, tokens, world) or last[0] is None:
            return
        from_tps = tokens / world / tps * (raw["step"] - last[1])
        between = stamp - last[0]
        if abs(from_tps - between) <= max(0.25 * between, 0.05):
            return
        self._clock_off += 1
        if self._clock_off > 1:  # the first one says it; the others are counted
            more = self._clock_off - 1
            first = self.problems[self._clock_problem].split(" (and ")[0]
            self.problems[self._clock_problem] = (
                f"{first} (and {more} more such step{'s' if more > 1 else ''})"
            )
            return
        self._clock_problem = len(self.problems)
        ranks = f"{world:g} rank{'s' if world != 1 else ''}"
        self.problems.append(
            f"step {raw['step']}: tps {tps:,.0f} per device means {from_tps:.3f} s for "
            f"{tokens:g} tokens over {ranks}, but the log's own stamps say {between:.3f} s: the "
            f"trainer does not run the shape it was given (training.global_batch, "
            f"training.sequence_length, mesh), or the line is damaged"
        )

    def _note_other(self, who: tuple | None, text: str) -> None:
        if self.log_format in ("megatron", "nemo"):
            gib = memory_gib(text)
            if gib is not None:
                self._memory.append(gib)
        if self.log_format == "torchtitan" and _TITAN_VALIDATE_RE.search(text):
            self._validation_lines += 1
            if who in self._clock:  # validation resets torchtitan's clock: the next step's
                self._clock[who][0] = _timestamp(text)  # rate leaves it out

    def _nemo_step(self, raw: dict) -> int:
        # NeMo's global_step counts from 0; so does `iteration` in the releases that print it
        if raw.get("global_step") is not None:
            return raw["global_step"] + 1
        if self._nemo_offset is None:
            self._nemo_offset = 1 if raw["step"] == 0 else 0
        return raw["step"] + self._nemo_offset

    # -- normalization --

    def _normalize(self, cur: dict, prev: dict | None, used: set[str]) -> dict:
        """The contract sample of one combined step; `used` collects the derivations applied."""
        shape = self.shape
        tokens = shape.tokens_per_step(cur.get("global_batch"))
        world = shape.world_size
        step_time, tps = cur["step_time_s"], cur["tokens_per_s"]
        tps_device = cur["tokens_per_s_device"]
        if step_time is None and tps_device and tokens and world:
            step_time = tokens / world / tps_device
            used.add("time_from_device_tps")
        elif step_time is None and tps and tokens:
            step_time = tokens / tps
            used.add("time_from_tps")
        elif step_time is None and prev is not None and cur["timestamp"] and prev["timestamp"]:
            delta = cur["timestamp"] - prev["timestamp"]
            step_time = _positive(delta / (cur["step"] - prev["step"]))
            used.add("time_from_timestamps")
        if tps is None and tokens and step_time:
            tps = tokens / step_time
            used.add("tps_from_shape")
        elif tps is None and tps_device and world:
            tps = tps_device * world
            used.add("tps_from_device")
        sample = {
            "step": cur["step"],
            "max_steps": cur.get("max_steps"),
            "step_time_s": step_time,
            "tokens_per_s": tps,
        }
        for key in ("peak_mem_gib", "loss", "tflops", "mfu"):
            sample[key] = cur[key]
        if tps is None and tps_device is not None:
            sample["tokens_per_s_device"] = tps_device
        return sample

    def result(self) -> ParsedLog:
        repeats = (
            [f"step line(s) printed twice, the repeat dropped: step(s) "
             f"{', '.join(map(str, self._dropped_repeats))}"]
            if self._dropped_repeats else []
        )  # fmt: skip
        if self.log_format == "contract":
            steps = [self._raws[k][0] for k in sorted(self._raws)]
            return ParsedLog("contract", steps, repeats, self.env, [], len(steps), self.problems)
        used: set[str] = set()
        combined = [_combine(self._raws[k]) for k in sorted(self._raws)]
        if self.log_format == "megatron":
            _undo_megatron_first_average(combined, used)
        skipped = [c["step"] for c in combined if c["skipped"]]
        steps, prev = [], None
        for cur in combined:
            sample = self._normalize(cur, prev, used)
            interval = cur["step"] - prev["step"] if prev is not None else 1
            if interval > 1:
                sample["interval_steps"] = interval
            if cur["skipped"]:
                sample["skipped_iterations"] = int(cur["skipped"])
            else:
                steps.append(sample)
            prev = cur
        if self._memory:
            # a run-level report (after iterations 1 and 2, say), not per step: every step gets it
            peak = max(self._memory)
            for sample in steps:
                sample["peak_mem_gib"] = max(peak, sample["peak_mem_gib"] or 0.0)
            used.add("memory_reports")
        derivations = self._derivations(used, combined, steps, skipped) + repeats
        return ParsedLog(self.log_format, steps, derivations, self.env, skipped, len(combined),
                         self.problems)  # fmt: skip

    def _derivations(
        self, used: set[str], combined: list[dict], steps: list[dict], skipped: list[int]
    ) -> list[str]:
        shape, notes = self.shape, []
        tokens = shape.tokens_per_step(
            next((c["global_batch"] for c in combined if c["global_batch"]), None)
        )
        if "time_from_device_tps" in used:
            notes.append(
                f"step_time_s = global batch x sequence length / world / tps = "
                f"{tokens:g} / {shape.world_size} / tps (torchtitan's tps is tokens/s per device)"
            )
        if "time_from_tps" in used:
            notes.append(f"step_time_s = {tokens:g} tokens per step / tokens_per_s")
        if "time_from_timestamps" in used:
            notes.append(
                "step_time_s derived from the lines' timestamps (delta time / delta "
                "step); the first step has none"
            )
        if "megatron_first_average" in used:
            k = combined[1]["step"]
            notes.append(
                f"step {k}: Megatron printed the mean over iterations 1-{k} (its interval timer "
                f"is not reset after iteration 1, as the lines' timestamps show); step {k}'s own "
                f"time is ({k} x printed - step 1's) / {k - 1}, its TFLOP/s scaled to match"
            )
        if "tps_from_shape" in used:
            notes.append(
                f"tokens_per_s = global batch x sequence length / step time = "
                f"{tokens:g} / step_time_s (global)"
            )
        if "tps_from_device" in used:
            notes.append(f"tokens_per_s = per-device tps x world ({shape.world_size}) (global)")
        unknown_tps = [s for s in steps if s["tokens_per_s"] is None]
        if any("tokens_per_s_device" in s for s in unknown_tps):
            notes.append(
                "tokens_per_s unknown where the per-device figure cannot be made "
                "global: give the global batch, sequence length and world size"
            )
        elif unknown_tps:  # from a step time: tokens per step is all it takes
            notes.append(
                "tokens_per_s unknown: the lines print none; give the global batch and "
                "sequence length (tokens/s = global batch x sequence length / step time)"
            )
        if any(s["step_time_s"] is None for s in steps[1:]):
            notes.append(
                "step time unknown for some steps: no step time, tokens/s with a known "
                "shape, or timestamps on the lines"
            )
        if any(c["ranks"] > 1 for c in combined):
            notes.append(
                "steps printed by several ranks: the slowest rank's step time, the "
                "largest memory over ranks"
            )
        intervals = sorted({s["interval_steps"] for s in steps if "interval_steps" in s})
        if intervals:
            notes.append(
                f"values averaged over log intervals of {', '.join(map(str, intervals))} "
                f"steps (interval_steps): log every step for per-step figures"
            )
        if skipped:
            notes.append(
                f"skipped iterations (no update, loss-scale overflow) not counted: "
                f"step(s) {', '.join(map(str, skipped))}"
            )
        if "memory_reports" in used:
            notes.append(
                "peak_mem_gib: the largest memory report of the run (max reserved), "
                "given to every step"
            )
        if self._validation_lines:
            notes.append(f"{self._validation_lines} `validate step:` line(s) ignored (evaluation)")
        return notes


# ---- whole logs ------------------------------------------------------------------------------


def parse_lines(
    lines: Iterable[str], log_format: str = "auto", shape: RunShape | None = None,
    source: str = "the log",
) -> ParsedLog:  # fmt: skip
    """The normalized steps of these lines; `auto` detects the format. Raises UnknownFormat
    when `auto` finds no line of any format (`source` names the lines in its message)."""
    tee = TeeLines()
    lines = [whole for line in lines for whole in tee.split(line)] + tee.rest()
    if log_format == "auto":
        log_format = detect_format(lines)
        if log_format is None:
            raise UnknownFormat(source)
    reader = LogReader(log_format, shape)
    for line in lines:
        reader.feed(line)
    return reader.result()


def parse_log(
    path: Path | str, log_format: str = "auto", shape: RunShape | None = None
) -> ParsedLog:
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    return parse_lines(text.splitlines(), log_format, shape, source=str(path))
