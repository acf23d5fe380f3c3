"""The one interface every log format has (`LogFormat`): what a step line reads as, and each
quirk the reader asks about. The reader (reader.py) keeps the bookkeeping that is the same for
all: ranks, order, repeats, problems; a format says only what is its own.

Most formats print figures that are not yet the contract's (per device, averaged, several
ranks' copies of one step): their steps are combined and normalized (normalize.py). The
contract's lines are the result as printed, and its class says so by overriding `add` and
`steps`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_perf.logs.lines import srun_label
from moe_perf.logs.normalize import derivations, normalize, normalize_all
from moe_perf.logs.steps import RunShape, combine


@dataclass
class Steps:
    """A whole log's steps as a format reads them."""

    samples: list[dict]  # normalized samples (STEP keys, max_steps, interval_steps where > 1)
    derivations: list[str] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # skipped iterations (no update)
    reported: int = 0  # step numbers printed, skipped ones included


class LogFormat:
    """One trainer's step lines. `name` is trainer.log_format's value; `first_words` how a step
    line begins, for a message that says what was looked for. One instance reads one log: a
    format may keep what its earlier lines said."""

    name = ""
    first_words = ""
    # every rank may print its own copy of a step; where only one rank prints (the contract),
    # other ranks' lines are no step lines, and a line out of order is no copy of a shown step
    every_rank_prints = True

    def parse(self, text: str) -> dict | None:
        """The raw figures of one cleaned line, or None for a line that is no step line."""
        raise NotImplementedError

    def describe(self) -> str:
        return f"log format {self.name}"

    def no_steps(self) -> str:
        """Why an arm whose log has no step line of this format has no metrics."""
        return f"no metrics: the trainer printed no step lines of {self.describe()}"

    # -- one line --

    def reads_rank(self, rank: int | None) -> bool:
        """Whether the lines of this torchrun rank (None: no prefix) are this format's."""
        return self.every_rank_prints or rank in (None, 0)

    def who(self, rank: int | None, line: str) -> tuple | None:
        """Who printed a step line, for its order: srun --label's task (the node) as well, where
        torchrun's prefix has the local rank (its default; a log from another launch) and is the
        same on each node; None where lines of several ranks cannot be told apart."""
        return None if rank is None else (srun_label(line), rank)

    def step(self, raw: dict) -> int:
        """The optimizer step a step line is of, counted from 1."""
        return raw["step"]

    def check(self, who: tuple | None, raw: dict, shape: RunShape, problems: list[str]) -> None:
        """Adds to `problems` what is wrong with a step line beyond its values."""

    def other_line(self, who: tuple | None, text: str) -> None:
        """A line that is no step line, for what else it may say (a memory report)."""

    # -- the steps --

    def add(self, raws: dict[int, list[dict]], raw: dict, shape: RunShape) -> dict | None:
        """Keeps a step line that counts; the sample to show if its step is new, else None."""
        new = raw["step"] not in raws
        raws.setdefault(raw["step"], []).append(raw)
        if not new:
            return None
        previous = max((k for k in raws if k < raw["step"]), default=None)
        prev = combine(raws[previous]) if previous is not None else None
        return normalize(combine([raw]), prev, set(), shape)

    def steps(self, raws: dict[int, list[dict]], shape: RunShape) -> Steps:
        """Every step of the log, combined over ranks and normalized, with the words."""
        used: set[str] = set()
        combined = [combine(raws[k]) for k in sorted(raws)]
        corrections = self.correct(combined)
        samples = normalize_all(combined, used, shape)
        peak = self.peak_memory()
        if peak is not None:
            # a run-level report (after iterations 1 and 2, say), not per step: every step gets it
            for sample in samples:
                sample["peak_mem_gib"] = max(peak, sample["peak_mem_gib"] or 0.0)
            used.add("memory_reports")
        words = derivations(shape, used, combined, samples, corrections) + self.notes()
        skipped = [c["step"] for c in combined if c["skipped"]]
        return Steps(samples, words, skipped, len(combined))

    def correct(self, combined: list[dict]) -> list[str]:
        """Mends printed figures known to be wrong, in place; a sentence for each mend."""
        return []

    def peak_memory(self) -> float | None:
        """The run's peak memory (GiB) from lines other than the step lines, where printed."""
        return None

    def notes(self) -> list[str]:
        """What else the reader should know of how this format's lines were read."""
        return []
