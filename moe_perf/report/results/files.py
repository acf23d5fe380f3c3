"""Strict JSON on disk: every file moe_perf writes (records, comparisons, a sweep's state) is
read by any strict parser and is written whole or not at all."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


def _finite(value: object) -> object:
    """NaN and infinity are no JSON: null (unknown) in their place, everywhere in `value`."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def strict_json(value: object, indent: int | None = 2) -> str:
    """JSON that every strict parser reads: no NaN or Infinity (null instead)."""
    return json.dumps(_finite(value), indent=indent, default=str, allow_nan=False)


def write_json(path: Path, value: object) -> None:
    """Written whole or not at all (a reader never sees half a file), as strict JSON."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(strict_json(value) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_json(path: Path) -> object:
    return json.loads(Path(path).read_text(encoding="utf-8"))
