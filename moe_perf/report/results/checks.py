"""What an arm record of each schema this code reads holds: the keys the comparison reads, with
their types, each step's number and metrics, the summary's figures. A file that fails is
refused with its first problems named, never half-read."""

from __future__ import annotations

import json

from moe_perf.common.contract import METRICS

SCHEMA = "moe_perf.arm/2"  # /2 added the settling keys to the summary
# Every version this code reads; /1 summaries dropped step 1 alone (recomputed when read).
SCHEMAS_READ = ("moe_perf.arm/1", SCHEMA)

_NUMBER = (int, float)
RECORD_TYPES: dict[str, tuple[tuple, bool]] = {  # key: (types, may be null)
    "schema": ((str,), False),
    "sweep_id": ((str,), True),
    "model": ((str,), False),
    "tag": ((str,), False),
    "arm": ((str,), False),
    "repeat": ((int,), False),
    "ref": ((str,), True),
    "sha": ((str,), True),
    "status": ((str,), False),
    "exit_code": ((int,), True),
    "failure": ((str,), True),
    "steps": ((list,), False),
    "summary": ((dict,), False),
    "environment": ((dict,), True),
    "config": ((dict,), True),
}
# The summary's keys that hold no number; every other summary key is a number or null.
SUMMARY_TYPES: dict[str, tuple[tuple, bool]] = {
    "settled": ((bool,), False),
    "settling": ((str,), True),
}


def _type_problem(where: str, value: object, types: tuple, nullable: bool) -> str | None:
    if value is None and nullable:
        return None
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        # a bool is an int to Python, but no number here
        want = " or ".join(t.__name__ for t in types) + (" or null" if nullable else "")
        return f"{where} is {json.dumps(value, default=str)[:40]}, not {want}"
    return None


def _key_problems(record: dict) -> list[str]:
    problems = []
    for key, (types, nullable) in RECORD_TYPES.items():
        if key not in record:
            if not nullable:
                problems.append(f"no {key!r}")
            continue
        problem = _type_problem(key, record[key], types, nullable)
        if problem:
            problems.append(problem)
    if record.get("status") not in (None, "ok", "failed"):
        problems.append(f"status is {record['status']!r}, not 'ok' or 'failed'")
    return problems


def _step_problems(steps: object) -> list[str]:
    problems: list[str] = []
    for i, step in enumerate(steps if isinstance(steps, list) else []):
        if not isinstance(step, dict):
            problems.append(f"steps[{i}] is not an object")
            continue
        problems += filter(None, [_type_problem(f"steps[{i}].step", step.get("step"), (int,),
                                                False)])  # fmt: skip
        problems += filter(None, (_type_problem(f"steps[{i}].{key}", step.get(key), _NUMBER, True)
                                  for key in METRICS))  # fmt: skip
    return problems


def _summary_problems(summary: object) -> list[str]:
    summary = summary if isinstance(summary, dict) else {}
    return list(filter(None, (_type_problem(f"summary.{key}", value,
                                            *SUMMARY_TYPES.get(key, (_NUMBER, True)))
                              for key, value in summary.items())))  # fmt: skip


def record_problems(record: object) -> list[str]:
    """Why `record` is not an arm record of a schema this code reads ([] when it is one): the
    keys the comparison reads, with their types, and each step's number and metrics."""
    if not isinstance(record, dict):
        return [f"the file holds a JSON {type(record).__name__}, not an object"]
    schema = record.get("schema")
    if schema not in SCHEMAS_READ:  # a later version's record included: its summary may differ
        return [f"schema {schema!r} is not one this moe_perf reads ({', '.join(SCHEMAS_READ)})"]
    return (_key_problems(record) + _step_problems(record.get("steps"))
            + _summary_problems(record.get("summary")))  # fmt: skip


def problems_line(problems: list[str]) -> str:
    """The first three problems in one line, and how many more there are."""
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return f"{'; '.join(problems[:3])}{more}"
