"""A config field's range or choices, kept in the field's metadata, and the check that reads
them: one message per value outside its bounds, naming the override to change.

The same check serves the runner before launch (runner/schema.py) and the trainer at start-up
(common/config.py), so both sides refuse the same values with the same words.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any, get_type_hints


@dataclass(frozen=True)
class Bounds:
    """The values a field may take: at least `min`, above `above`, at most `max`, or one of
    `choices`. None (for an Optional field) is always allowed."""

    min: float | None = None
    above: float | None = None
    max: float | None = None
    choices: tuple = ()
    why: str = ""  # the reason for the bound, shown with it

    def problem(self, key: str, value: Any) -> str | None:
        if value is None or self == Bounds():
            return None
        why = f" ({self.why})" if self.why else ""
        if self.choices:
            if value in self.choices:
                return None
            return (
                f"{key}={value}: expected one of {', '.join(map(str, self.choices))}; change {key}"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"{key}={value!r} is not a number; change {key}"
        rules = (
            (self.min, ">=", lambda bound: value >= bound),
            (self.above, ">", lambda bound: value > bound),
            (self.max, "<=", lambda bound: value <= bound),
        )
        for bound, rule, holds in rules:
            if bound is not None and not holds(bound):  # NaN fails every rule
                return f"{key}={value} must be {rule} {bound:g}{why}; change {key}"
        return None


def knob(default: Any = dataclasses.MISSING, **bounds) -> Any:
    """A dataclass field with its bounds (`knob(2048, min=1)`; no default: required)."""
    return field(default=default, metadata={"bounds": Bounds(**bounds)})


def check_values(cls: type, values: Any, section: str) -> list[str]:
    """One message per value of `values` (a mapping or an instance of `cls`) outside its
    field's bounds, nested dataclass sections included, keys as `section.key`."""
    problems = []
    for f in dataclasses.fields(cls):
        bounds = f.metadata.get("bounds")
        nested = _field_types(cls)[f.name]
        nested = nested if isinstance(nested, type) and dataclasses.is_dataclass(nested) else None
        if bounds is None and nested is None:
            continue
        if isinstance(values, Mapping):
            if f.name not in values:
                continue
            value = values[f.name]
        else:
            value = getattr(values, f.name)
        key = f"{section}.{f.name}" if section else f.name
        problem = bounds.problem(key, value) if bounds is not None else None
        if problem:
            problems.append(problem)
        if nested is not None and value is not None:
            problems += check_values(nested, value, key)
    return problems


@cache
def _field_types(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)  # the annotations are strings (from __future__ import annotations)
