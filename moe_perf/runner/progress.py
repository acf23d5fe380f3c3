"""What the console says while a sweep runs: which arm of how many, why nothing prints yet,
each step with the time spent and the time left, and how many threads each rank gets.

Pure Python and stateless except for `StepProgress`, which remembers when the step lines of one
arm arrived, and `UnmatchedLines`, which watches for step lines the log format misses. The
launch's reader (launchers/process.py) feeds them one line at a time.
"""

from __future__ import annotations

import os
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from moe_perf.report.logformats import clean, detect_format


def shown(value: float | None, spec: str) -> str:
    return "?" if value is None else format(value, spec)


def clock_time(seconds: float) -> str:
    """`0:42`, `12:05`, `1:02:03`: what people read at a glance."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class StepProgress:
    """One arm's step lines: `[base] step 3/8  0.4121 s  159,021 tokens/s  peak 12.40 GiB
    loss 10.8  elapsed 0:42  ETA 2:10`.

    Elapsed counts from the launch (start-up included). The ETA is the steps left times the
    median wall time between step lines, which includes whatever the trainer does between two
    timed steps; step 1 carries warm-up and compilation, so until step 2 arrives the ETA uses
    step 1's time and is marked as an upper bound (`ETA <0:30`).
    """

    def __init__(self, label: str, max_steps: int | None,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.label, self.max_steps, self.clock = label, max_steps, clock
        self.started = clock()
        self.arrivals: list[float] = []

    def eta(self, step: int, total: int | None, step_time_s: float | None) -> str | None:
        if not total or step >= total or not self.arrivals:
            return None
        left = total - step
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]
        if gaps:
            return clock_time(left * statistics.median(gaps))
        first = step_time_s if step_time_s is not None else self.arrivals[0] - self.started
        return "<" + clock_time(left * first)

    def line(self, sample: dict) -> str:
        self.arrivals.append(self.clock())
        total = sample.get("max_steps") or self.max_steps
        step = int(sample["step"])
        parts = [f"[{self.label}] step {step}/{total or '?'}"]
        parts.append(f"{shown(sample.get('step_time_s'), '.4f')} s")
        parts.append(f"{shown(sample.get('tokens_per_s'), ',.0f')} tokens/s")
        parts.append(f"peak {shown(sample.get('peak_mem_gib'), '.2f')} GiB")
        if sample.get("loss") is not None:
            parts.append(f"loss {sample['loss']:.4g}")
        parts.append(f"elapsed {clock_time(self.arrivals[-1] - self.started)}")
        eta = self.eta(step, total, sample.get("step_time_s"))
        if eta:
            parts.append(f"ETA {eta}")
        return "  ".join(parts)


# ---- a log format that reads nothing --------------------------------------------------------

_NUMBER_RE = re.compile(r"[-+]?\d[\d,]*(?:\.\d*)?(?:[eE][-+]?\d+)?")
_STEP_WORD_RE = re.compile(r"\b(?:step|iter(?:ation)?)\b\D{0,3}\d", re.IGNORECASE)


class UnmatchedLines:
    """Says once, while the arm runs, that its log format reads none of what look like step
    lines: before any step line was read, rank 0 printed REPEATS lines of one shape (the same
    text around other numbers) or REPEATS lines that say `step N` / `iter N`. Otherwise a
    format that matches nothing is only reported when the arm ends, with no metrics."""

    REPEATS = 3

    def __init__(self, log_format: str) -> None:
        self.log_format = log_format
        self.shapes: Counter = Counter()
        self.step_words, self.lines = 0, 0
        self.done = False  # a step line was read, or the warning given

    def feed(self, line: str, step_line: bool) -> str | None:
        """The warning to print for this line (once), or None."""
        self.done = self.done or step_line
        rank, text = clean(line)
        text = text.strip()
        if self.done or rank not in (None, 0) or not text:
            return None
        self.lines += 1
        shape = _NUMBER_RE.sub("#", text)
        self.shapes[shape] += "#" in shape
        self.step_words += bool(_STEP_WORD_RE.search(text))
        if max(self.shapes[shape], self.step_words) < self.REPEATS:
            return None
        self.done = True
        return self.warning(text)

    def warning(self, text: str) -> str:
        known = detect_format([text])
        hint = f"; that line reads as {known}'s: trainer.log_format={known}?" if known else ""
        return (f"trainer.log_format={self.log_format!r} has read no step from the {self.lines} "
                f"lines the trainer printed so far, though they look like step lines, e.g. "
                f"{text!r}{hint}; unless a later line matches, the arm ends with no metrics "
                f"(Ctrl-C stops the sweep)")  # fmt: skip


# ---- threads per rank ------------------------------------------------------------------------


@dataclass(frozen=True)
class RankThreads:
    """OMP_NUM_THREADS for each rank of one launch, and where that number came from.

    torchrun sets 1 thread per rank on its own, with a four-line banner, whenever more than one
    process starts and OMP_NUM_THREADS is unset. moe_perf sets it instead, to the cores this
    process may use less one (the runner reads every line the ranks print) divided by the ranks
    on this node, at least 1; an OMP_NUM_THREADS in the environment is kept. On a 2-core VM a
    single rank with 2 threads ran A/A pairs 21-23% apart (each process settling at 0.62 or
    0.80 s per step); with 1 thread, 2%.
    """

    threads: int
    cores: int
    ranks: int
    from_environment: bool

    @classmethod
    def for_launch(cls, nproc_per_node: int) -> RankThreads:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        cores, ranks = cores or 1, max(1, int(nproc_per_node))
        given = os.environ.get("OMP_NUM_THREADS", "")
        if given.isdigit() and int(given) > 0:
            return cls(int(given), cores, ranks, from_environment=True)
        return cls(max(1, (cores - 1) // ranks), cores, ranks, from_environment=False)

    @property
    def env(self) -> dict[str, str]:
        return {} if self.from_environment else {"OMP_NUM_THREADS": str(self.threads)}

    def describe(self) -> str:
        ranks = f"{self.ranks} rank{'s' if self.ranks > 1 else ''}"
        if self.from_environment:
            return f"{ranks}, OMP_NUM_THREADS={self.threads} each (from your environment)"
        return (f"{ranks}, OMP_NUM_THREADS={self.threads} each ({self.cores} cores - 1 for "
                f"the runner, / {self.ranks}; set OMP_NUM_THREADS to choose)")  # fmt: skip


# ---- the arm's first lines -------------------------------------------------------------------


def arm_count(num: int, total: int | None) -> str:
    """`arm 2/4` in a sweep whose jobs are known, `arm 2` otherwise."""
    return f"arm {num + 1}/{total}" if total else f"arm {num + 1}"


def starting_line(label: str, threads: RankThreads, compiled: bool, torchrun: bool = True) -> str:
    """Why the next minute may be silent: start-up, model build and the first step."""
    first = "the first step compiles" if compiled else "the first step warms up"
    how = "torchrun with" if torchrun else "one process, no torchrun:"
    return (f"{label}: starting: {how} {threads.describe()}; trainer start-up, model "
            f"build and {first} before step 1 prints")  # fmt: skip
