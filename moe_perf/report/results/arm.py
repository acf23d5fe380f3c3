"""One arm's record as typed values: `ArmRecord` (metrics.json, schema moe_perf.arm/2), its
`Step`s and its `Summary`, each read from and written to the file's own JSON.

`Summary.of(steps)` is the one summary rule: step 1 dropped (warm-up, compilation), then the
leading steps still settling (moe_perf.stats.steady), medians of the remaining steps, peak
memory as their maximum. The summary says how many steps settled and whether the run settled.

A record round-trips: `ArmRecord.from_dict(d).to_dict() == d` for a record moe_perf wrote, keys
in the order written, so a file loaded and dumped again is the same file. Keys this code does
not model (the build, the imports, the compile cache...) are kept as they are in `extra`.
A /1 record (its summary dropped step 1 alone) is read with its summary recomputed from its
steps; a record of a later schema is refused (its summary may mean something else).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_perf.common.contract import METRICS
from moe_perf.report.results.checks import SCHEMA, problems_line, record_problems
from moe_perf.report.results.files import read_json, write_json
from moe_perf.stats.steady import Settling, settle

STEP_KEYS = ("step", *METRICS)
# summarized by their median; peak memory by its maximum; loss is shown per step only
MEDIAN_METRICS = tuple(m for m in METRICS if m not in ("peak_mem_gib", "loss"))
# The routing a step had, per step from the reference trainer (docs/routing.md): summarized by
# their median, only where a trainer printed them.
IMBALANCE_METRICS = ("expert_imbalance", "rank_imbalance")
SETTLING_KEYS = ("steps_settling", "settled", "settling")  # the summary's keys since /2


class RecordError(ValueError):
    """A file that is not an arm record this code reads; the message says why, in one line."""


def _median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _maximum(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


@dataclass(frozen=True)
class Step:
    """One optimizer step as the trainer printed it; None where a value was unknown."""

    step: int
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    peak_mem_gib: float | None = None
    loss: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # other key=value pairs printed

    def value(self, key: str) -> Any:
        """A metric of the contract or any other key the trainer printed (None: not printed)."""
        return getattr(self, key) if key in STEP_KEYS else self.extra.get(key)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Step:
        extra = {k: v for k, v in d.items() if k not in STEP_KEYS}
        return cls(**{k: d.get(k) for k in STEP_KEYS}, extra=extra)

    def to_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in STEP_KEYS}, **self.extra}


def settling(steps: Sequence[Step]) -> tuple[list[Step], Settling]:
    """(the steps a summary uses, the settling found): step 1 dropped, then the leading steps
    the steady-state rule finds still settling, judged by the step times that are known."""
    after_first = sorted(steps, key=lambda s: s.step)[1:]
    timed = [s for s in after_first if s.step_time_s is not None]
    found = settle([s.step for s in timed], [s.step_time_s for s in timed])
    if not found.dropped:
        return after_first, found
    return [s for s in after_first if s.step >= found.first_steady_step], found


@dataclass(frozen=True)
class Summary:
    """A run's figures: medians of its measured steps, peak memory their maximum.

    `steps_settling` counts the steps dropped after step 1, `settled` is False for a run that
    never settled, `settling` says why in words; all three are None in a /1 summary. A metric
    nobody reported is None; the imbalance figures only exist where a trainer printed them.
    """

    steps_measured: int | None = None
    steps_settling: int | None = None
    settled: bool | None = None
    settling: str | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    peak_mem_gib: float | None = None
    expert_imbalance: float | None = None
    rank_imbalance: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # figures of a later version

    FIGURES = (*MEDIAN_METRICS, "peak_mem_gib")

    @classmethod
    def of(cls, steps: Sequence[Step]) -> Summary:
        """The summary rule. Values a trainer left empty are skipped, never read as 0."""
        measured, found = settling(steps)
        return cls(
            steps_measured=len(measured),
            steps_settling=max(len(steps) - 1, 0) - len(measured),
            settled=found.settled,
            settling=found.reason or None,
            **{key: _median(s.value(key) for s in measured) for key in MEDIAN_METRICS},
            peak_mem_gib=_maximum(s.peak_mem_gib for s in measured),
            **{key: _median(s.value(key) for s in measured) for key in IMBALANCE_METRICS},
        )

    def value(self, key: str) -> Any:
        return getattr(self, key) if key in self._keys() else self.extra.get(key)

    @classmethod
    def _keys(cls) -> tuple[str, ...]:
        return ("steps_measured", *SETTLING_KEYS, *cls.FIGURES, *IMBALANCE_METRICS)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Summary:
        extra = {k: v for k, v in d.items() if k not in cls._keys()}
        return cls(**{k: d.get(k) for k in cls._keys()}, extra=extra)

    def to_dict(self) -> dict:
        """The settling keys only where they were judged (/2); imbalance only where printed."""
        keys = [
            "steps_measured",
            *(SETTLING_KEYS if self.settled is not None else ()),
            *self.FIGURES,
            *(k for k in IMBALANCE_METRICS if getattr(self, k) is not None),
        ]
        return {**{k: getattr(self, k) for k in keys}, **self.extra}  # fmt: skip


# The record's modelled keys, in the order the runner writes them; `extra` goes before config.
_HEAD = ("schema", "sweep_id", "model", "tag", "arm", "repeat", "ref", "sha", "status",
         "exit_code", "failure", "arm_dir", "log", "started", "finished", "wall_time_s",
         "trainer_wall_s")  # fmt: skip
_DATA = ("steps", "summary", "environment", "config")


@dataclass(frozen=True)
class ArmRecord:
    """One arm's run: who it was (model, tag, arm, repeat, commit), how it ended, where its
    files are, its steps and summary, the environment and the composed config."""

    arm: str
    model: str = "-"
    tag: str = "-"
    repeat: int = 0
    schema: str = SCHEMA  # the schema the record was written with
    sweep_id: str | None = None
    ref: str | None = None
    sha: str | None = None
    status: str = "ok"  # ok | failed
    exit_code: int | None = None
    failure: str | None = None  # why the arm failed, in one line
    arm_dir: str | None = None
    log: str | None = None  # the arm's console.log
    started: str | None = None  # ISO-8601
    finished: str | None = None
    wall_time_s: float | None = None
    trainer_wall_s: float | None = None
    steps: tuple[Step, ...] = ()
    summary: Summary = field(default_factory=Summary)
    environment: Mapping[str, Any] | None = None  # host, versions, devices, world size
    config: Mapping[str, Any] | None = None  # the composed config the arm ran
    extra: Mapping[str, Any] = field(default_factory=dict)  # build, imports, compile cache...
    path: Path | None = field(default=None, compare=False)  # where it was read from

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def build(self) -> Mapping[str, Any] | None:
        """trainer.build's outcome: its command, status and failure (None: no build step)."""
        return self.extra.get("build")

    @property
    def imports(self) -> tuple[Mapping[str, Any], ...]:
        """The file and hash each checked module was loaded from (runner/verify_imports.py)."""
        return tuple(self.extra.get("imports") or ())

    @property
    def log_format(self) -> str | None:
        return self.extra.get("log_format")

    @property
    def derivations(self) -> tuple[str, ...]:
        """How figures the trainer did not print were derived from what it printed."""
        return tuple(self.extra.get("derivations") or ())

    def section(self, *keys: str) -> Any:
        """A value of the composed config by its path (None where absent)."""
        node: Any = self.config or {}
        for key in keys:
            node = node.get(key) if isinstance(node, Mapping) else None
        return node

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], path: Path | None = None) -> ArmRecord:
        """A validated record; a /1 record's summary recomputed from its steps."""
        problems = record_problems(d)
        if problems:
            where = f"{path}: " if path is not None else ""
            raise RecordError(f"{where}not a {SCHEMA} record: {problems_line(problems)}")
        modelled = {*_HEAD, *_DATA}
        record = cls(
            **{k: d.get(k) for k in _HEAD},
            steps=tuple(Step.from_dict(s) for s in d["steps"]),
            summary=Summary.from_dict(d["summary"]),
            environment=d.get("environment"),
            config=d.get("config"),
            extra={k: v for k, v in d.items() if k not in modelled},
            path=path,
        )
        return record._read_as_current()

    def _read_as_current(self) -> ArmRecord:
        """An older record's summary recomputed by today's rule; `summary_recomputed` says so.
        Without steps it stays as written."""
        if self.schema == SCHEMA or not self.steps:
            return self
        said = {"summary_recomputed": f"from the steps of a {self.schema} record"}
        return dataclasses.replace(self, summary=Summary.of(self.steps),
                                   extra={**self.extra, **said})  # fmt: skip

    def to_dict(self) -> dict:
        return {
            **{k: getattr(self, k) for k in _HEAD},
            "steps": [s.to_dict() for s in self.steps],
            "summary": self.summary.to_dict(),
            "environment": self.environment,
            **self.extra,
            "config": self.config,
        }

    @classmethod
    def load(cls, path: Path | str) -> ArmRecord:
        """The record of a metrics.json, its own paths (`arm_dir`, `log`) where it lies now;
        RecordError (one line, the path first) for a file that is not one."""
        path = Path(path)
        try:
            data = read_json(path)
        except (OSError, ValueError) as exc:
            raise RecordError(f"{path}: unreadable ({exc})") from exc
        return cls.from_dict(data, path).relocated(path.parent)

    def dump(self, path: Path | str) -> None:
        """Written whole or not at all, as strict JSON (NaN and infinity as null)."""
        write_json(Path(path), self.to_dict())

    def relocated(self, arm_dir: Path) -> ArmRecord:
        """The record's own paths where it is read from now: an earlier sweep moved to
        previous/<id>/ keeps the paths it was written with."""
        written, now = self.arm_dir, Path(arm_dir).resolve()
        if not written or Path(written) == now:
            return self
        log = self.log
        if log and Path(log).parent == Path(written):
            log = str(now / Path(log).name)
        return dataclasses.replace(self, arm_dir=str(now), log=log)
