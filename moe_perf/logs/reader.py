"""A trainer's console output read line by line into steps (`LogReader`), and whole logs
(`parse_lines`, `parse_log`).

Validation, before a line counts: a step time or tokens/s that is printed but not a positive
finite number, a step beyond the line's own `/N`, a step printed after a later one, or a step
printed twice with different values by the same rank is a `problem`: the log cannot stand as a
result (`ParsedLog.failure`). The same line printed twice is dropped with a note. Before any of
this, a line torchrun --tee passed on in two pieces is made whole again (`TeeLines`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from moe_perf.common.contract import parse_env
from moe_perf.logs.formats import UnknownFormat, detect_format, format_named
from moe_perf.logs.lines import TeeLines, clean
from moe_perf.logs.steps import RunShape, figures, value_problems


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
            return format_named(self.log_format).no_steps()
        if not any(s.get("step_time_s") is not None for s in self.steps):
            return f"no step time in the trainer's {self.describe()} lines: " + "; ".join(
                self.derivations
            )
        if self.steps_reported < max_steps:
            return f"only {self.steps_reported} of {max_steps} steps reported"
        return None

    def describe(self) -> str:
        return format_named(self.log_format).describe()


class LogReader:
    """Reads a trainer's output line by line (every rank's, prefixes included) in one format;
    `feed` gives a sample per new step for progress, `result()` the normalized steps. What is
    the same for every format lives here (ranks, order, repeats, problems); what is a format's
    own, in its class (logs/base.py)."""

    def __init__(self, log_format: str, shape: RunShape | None = None):
        self.log_format = log_format
        self.format = format_named(log_format)
        self.shape = shape or RunShape()
        self._raws: dict[int, list[dict]] = {}  # step -> every counted line of it
        self._last: dict = {}  # per rank (and node): the last step line it printed
        self._dropped_repeats: list[int] = []
        self.problems: list[str] = []
        self.env: dict | None = None
        self.step_line = False

    def feed(self, line: str) -> dict | None:
        """The sample to show for this line, or None; `step_line` says whether it was a step's
        line (a later rank's line of a step already shown gives None, but is one)."""
        rank, text = clean(line)
        self.step_line = False
        if not self.format.reads_rank(rank):
            return None
        env = parse_env(text)
        if env is not None:
            self.env = env
        who = self.format.who(rank, line)
        raw = self.format.parse(text)
        if raw is None:
            self.format.other_line(who, text)
            return None
        raw["step"] = self.format.step(raw)
        self.format.check(who, raw, self.shape, self.problems)
        self.problems.extend(value_problems(raw))
        if who is not None and not self._in_order(who, raw):
            # without a rank prefix every rank's line looks alike: no order check
            self.step_line = self.format.every_rank_prints  # else no copy of a shown step
            return None
        self.step_line = True
        return self.format.add(self._raws, raw, self.shape)

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
        elif figures(raw) == figures(last):
            self._dropped_repeats.append(step)
        else:
            self.problems.append(f"step {step} printed twice with different values")
        return False

    def result(self) -> ParsedLog:
        steps = self.format.steps(self._raws, self.shape)
        repeats = (
            [f"step line(s) printed twice, the repeat dropped: step(s) "
             f"{', '.join(map(str, self._dropped_repeats))}"]
            if self._dropped_repeats else []
        )  # fmt: skip
        return ParsedLog(self.log_format, steps.samples, steps.derivations + repeats, self.env,
                         steps.skipped, steps.reported, self.problems)  # fmt: skip


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
