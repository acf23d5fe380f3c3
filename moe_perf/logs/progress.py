"""What the console says of an arm's step lines as they are read: each step with the time
spent and the time left (`StepProgress`), and a warning when the log format reads none of what
look like step lines (`UnmatchedLines`). The launch's reader (launchers/process.py) feeds them
one line at a time; each remembers only the lines of one arm.
"""

from __future__ import annotations

import re
import statistics
import time
from collections import Counter
from collections.abc import Callable

from moe_perf.logs.formats import detect_format
from moe_perf.logs.lines import clean


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
