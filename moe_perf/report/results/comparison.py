"""A sweep's comparison as typed values: `Comparison` (comparison.json, schema
moe_perf.comparison/2), one `Group` per (model, tag), its `Run`s, each arm's `ArmFigures`, and
per metric the `Difference` between the arms and the `Verdict`.

`Comparison.from_dict(d).to_dict() == d` for a comparison moe_perf wrote, keys in the order
written. A /1 comparison (written before verdicts) is read with each group's `verdict` None and
its runs' summaries as /1 summaries (no settling keys). A later schema is refused.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_perf.common.contract import METRICS as STEP_METRICS
from moe_perf.report.results.arm import Summary
from moe_perf.report.results.files import read_json, write_json
from moe_perf.stats.words import Verdict

SCHEMA = "moe_perf.comparison/2"  # /2: each group's `verdict` and `plan`
SCHEMAS_READ = ("moe_perf.comparison/1", SCHEMA)
METRICS = tuple(m for m in STEP_METRICS if m != "loss")  # compared between arms


class ComparisonError(ValueError):
    """A file that is not a comparison this code reads; the message says why, in one line."""


@dataclass(frozen=True)
class Spread:
    """An arm's run medians of one metric: their median, and their min-max spread."""

    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread | None:
        return cls(statistics.median(values), min(values), max(values)) if values else None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Spread | None:
        return cls(d["median"], d["min"], d["max"]) if d else None

    def to_dict(self) -> dict:
        return {"median": self.median, "min": self.min, "max": self.max}


@dataclass(frozen=True)
class ArmFigures:
    """One arm of a group over its runs: how many ran, their commits, a Spread per metric."""

    runs_ok: int
    runs_failed: int
    shas: tuple[str, ...]
    refs: tuple[str, ...]
    figures: Mapping[str, Spread | None]  # metric -> its spread over the ok runs (None: none)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ArmFigures:
        counts = ("runs_ok", "runs_failed", "shas", "refs")
        figures = {k: Spread.from_dict(v) for k, v in d.items() if k not in counts}
        return cls(d["runs_ok"], d["runs_failed"], tuple(d["shas"]), tuple(d["refs"]), figures)

    def to_dict(self) -> dict:
        figures = {k: s.to_dict() if s else None for k, s in self.figures.items()}
        return {"runs_ok": self.runs_ok, "runs_failed": self.runs_failed,
                "shas": list(self.shas), "refs": list(self.refs), **figures}  # fmt: skip


@dataclass(frozen=True)
class Difference:
    """Feat against base for one metric: percent, in words, and whether the two arms' run
    spreads overlap (None: one run per arm gives no spread)."""

    pct: float
    words: str
    within_spread: bool | None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Difference | None:
        return cls(d["pct"], d["words"], d["within_spread"]) if d else None

    def to_dict(self) -> dict:
        return {"pct": self.pct, "words": self.words, "within_spread": self.within_spread}


_RUN_KEYS = ("arm", "repeat", "status", "exit_code", "failure", "sha", "ref", "log",
             "metrics_json")  # fmt: skip


@dataclass(frozen=True)
class Run:
    """One run of a group as the comparison saw it: its identity, summary and step times."""

    arm: str
    repeat: int
    status: str
    exit_code: int | None
    failure: str | None
    sha: str | None
    ref: str | None
    log: str | None
    metrics_json: str | None  # the record it was read from
    summary: Summary
    unstable: str | None  # why its step times are less reliable, in words
    unsettled: str | None  # why it never settled (the steady-state rule), in words
    step_times: tuple[tuple[int, float | None], ...]

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Run:
        return cls(**{k: d.get(k) for k in _RUN_KEYS}, summary=Summary.from_dict(d["summary"]),
                   unstable=d.get("unstable"), unsettled=d.get("unsettled"),
                   step_times=tuple((s, t) for s, t in d.get("step_times") or ()))  # fmt: skip

    def to_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in _RUN_KEYS}, "summary": self.summary.to_dict(),
                "unstable": self.unstable, "unsettled": self.unsettled,
                "step_times": [[s, t] for s, t in self.step_times]}  # fmt: skip


@dataclass(frozen=True)
class Group:
    """One (model, tag): its arms and runs, what differs besides the code, and the outcome.

    `status` is compared, incomplete (an arm has no successful run) or refused (the configs
    differ beyond arm and repeat). A compared group has its `plan`, `pairs` and a `verdict` per
    metric; `explain` and `routing` are their sections where the sweep asked for them.
    """

    model: str
    tag: str
    arms: Mapping[str, ArmFigures]
    runs: tuple[Run, ...]
    config_differences: tuple[Mapping[str, Any], ...]  # {key, values: {run label: value}}
    environment_differences: tuple[str, ...]
    import_warnings: tuple[str, ...]
    difference: Mapping[str, Difference | None]
    aa: bool  # base and feat are one commit: any difference is noise
    status: str
    plan: Mapping[str, Any] | None = None  # the decision plan, memory_tolerance included
    pairs: int | None = None
    verdict: Mapping[str, Verdict] | None = None  # None: not compared, or a /1 comparison
    unsettled_runs: tuple[str, ...] | None = None
    explain: Mapping[str, Any] | None = None
    routing: Mapping[str, Any] | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Group:
        verdict, unsettled = d.get("verdict"), d.get("unsettled_runs")
        return cls(
            model=d["model"], tag=d["tag"],
            arms={k: ArmFigures.from_dict(v) for k, v in d["arms"].items()},
            runs=tuple(Run.from_dict(r) for r in d["runs"]),
            config_differences=tuple(d.get("config_differences") or ()),
            environment_differences=tuple(d.get("environment_differences") or ()),
            import_warnings=tuple(d.get("import_warnings") or ()),
            difference={k: Difference.from_dict(v) for k, v in (d.get("difference") or {}).items()},
            aa=d["aa"], status=d["status"], plan=d.get("plan"), pairs=d.get("pairs"),
            verdict=None if verdict is None else {k: Verdict.from_dict(v)
                                                  for k, v in verdict.items()},
            unsettled_runs=None if unsettled is None else tuple(unsettled),
            explain=d.get("explain"), routing=d.get("routing"),
        )  # fmt: skip

    def to_dict(self) -> dict:
        """The keys a compared group alone has (plan, pairs...) only where they are set."""
        return {
            "model": self.model,
            "tag": self.tag,
            "arms": {k: a.to_dict() for k, a in self.arms.items()},
            "runs": [r.to_dict() for r in self.runs],
            "config_differences": list(self.config_differences),
            "environment_differences": list(self.environment_differences),
            "import_warnings": list(self.import_warnings),
            "difference": {k: d.to_dict() if d else None for k, d in self.difference.items()},
            "aa": self.aa,
            "status": self.status,
            **{k: v for k, v in self._when_set().items() if v is not None},
        }

    def _when_set(self) -> dict:
        verdict, unsettled = self.verdict, self.unsettled_runs
        return {
            "plan": self.plan,
            "pairs": self.pairs,
            "verdict": None if verdict is None else {k: v.to_dict() for k, v in verdict.items()},
            "unsettled_runs": None if unsettled is None else list(unsettled),
            "explain": self.explain,
            "routing": self.routing,
        }


@dataclass(frozen=True)
class Comparison:
    """The comparison of a sweep (or of two logs or records): one Group per (model, tag)."""

    groups: tuple[Group, ...]
    created: str  # ISO-8601, UTC
    sweep_id: str | list[str] | None  # several where records of several sweeps were compared
    unstable_spread: float  # the step-time spread above which a run is called unstable
    notes: tuple[str, ...] = ()
    schema: str = SCHEMA  # the schema it was written with
    sweep_dir: str | None = None  # None: not the comparison of a sweep directory
    files: Mapping[str, str | None] | None = None  # the Markdown and the picture written beside
    path: Path | None = field(default=None, compare=False)  # where it was read from

    @property
    def failed_runs(self) -> list[Run]:
        return [run for group in self.groups for run in group.runs if not run.ok]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], path: Path | None = None) -> Comparison:
        where = f"{path}: " if path is not None else ""
        if not isinstance(d, Mapping) or d.get("schema") not in SCHEMAS_READ:
            schema = d.get("schema") if isinstance(d, Mapping) else None
            raise ComparisonError(f"{where}schema {schema!r} is not one of "
                                  f"{', '.join(SCHEMAS_READ)}")  # fmt: skip
        try:
            return cls(groups=tuple(Group.from_dict(g) for g in d["groups"]),
                       created=d["created"], sweep_id=d["sweep_id"],
                       unstable_spread=d["unstable_spread"], notes=tuple(d.get("notes") or ()),
                       schema=d["schema"], sweep_dir=d.get("sweep_dir"), files=d.get("files"),
                       path=path)  # fmt: skip
        except (KeyError, TypeError, AttributeError) as exc:
            raise ComparisonError(f"{where}not a {d['schema']} comparison: {exc!r}") from exc

    def to_dict(self) -> dict:
        where = {"sweep_dir": self.sweep_dir} if self.sweep_dir is not None else {}
        files = {"files": self.files} if self.files is not None else {}
        groups = [g.to_dict() for g in self.groups]
        return {"schema": self.schema, "created": self.created, **where,
                "sweep_id": self.sweep_id, "unstable_spread": self.unstable_spread,
                "notes": list(self.notes), "groups": groups, **files}  # fmt: skip

    @classmethod
    def load(cls, path: Path | str) -> Comparison:
        """A comparison.json of this or an older schema; ComparisonError (one line, the path
        first) for a file that is none."""
        path = Path(path)
        try:
            data = read_json(path)
        except (OSError, ValueError) as exc:
            raise ComparisonError(f"{path}: unreadable ({exc})") from exc
        return cls.from_dict(data, path)

    def dump(self, path: Path | str) -> None:
        """Written whole or not at all, as strict JSON (NaN and infinity as null)."""
        write_json(Path(path), self.to_dict())
