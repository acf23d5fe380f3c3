"""One arm's record, `metrics.json` (schema `moe_perf.arm/2`): per-step samples, the summary,
the arm's commit, its exit status and the environment. Humans get a table (compare.py);
machines get this file.

`summarize(steps)` is the one summary rule (compare.py uses it too): step 1 dropped (warm-up,
compilation), then the leading steps still settling (moe_perf.stats.steady), medians of the
remaining steps, peak memory as their maximum. The summary says how many steps settled and
whether the run settled at all.

Schema /2 added the settling keys to the summary (`steps_settling`, `settled`, `settling`);
a /1 record (step 1 alone dropped) is read with its summary recomputed from its steps.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import socket
import statistics
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path

from moe_perf.common.contract import METRICS
from moe_perf.stats.steady import Settling, settle

SCHEMA = "moe_perf.arm/2"
# Every version this code reads; /1 summaries dropped step 1 alone (recomputed when read).
SCHEMAS_READ = ("moe_perf.arm/1", SCHEMA)
ARMS = ("base", "feat")
STEP_KEYS = ("step", *METRICS)
# summarized by their median; peak memory by its maximum; loss is shown per step only
MEDIAN_METRICS = tuple(m for m in METRICS if m not in ("peak_mem_gib", "loss"))
# The routing a step had, per step from the reference trainer (docs/routing.md): summarized by
# their median, only where a trainer printed them.
IMBALANCE_METRICS = ("expert_imbalance", "rank_imbalance")
# The identity rule: the only keys allowed to differ between the arms of one comparison.
ARM_KEYS = ("arm", "repeat")


def _median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _maximum(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def settling(steps: list[dict]) -> tuple[list[dict], Settling]:
    """(the steps a summary uses, the settling found): step 1 dropped, then the leading steps
    the steady-state rule finds still settling, judged by the step times that are known."""
    after_first = sorted(steps, key=lambda s: s["step"])[1:]
    timed = [s for s in after_first if s.get("step_time_s") is not None]
    found = settle([s["step"] for s in timed], [s["step_time_s"] for s in timed])
    if not found.dropped:
        return after_first, found
    return [s for s in after_first if s["step"] >= found.first_steady_step], found


def measured_steps(steps: list[dict]) -> list[dict]:
    """The steps a summary uses, in step order: step 1 and the settling steps dropped."""
    return settling(steps)[0]


def summarize(steps: list[dict]) -> dict:
    """Medians of the measured steps (step 1 and the settling steps dropped); peak memory is
    their maximum. `steps_settling` counts the steps dropped after step 1; `settled` is False
    for a run that never settled; `settling` says why, in words (None: nothing to say).

    Values a trainer left empty (unknown) are skipped, never read as 0; a metric nobody
    reported is None.
    """
    measured, found = settling(steps)
    summary: dict = {
        "steps_measured": len(measured),
        "steps_settling": max(len(steps) - 1, 0) - len(measured),
        "settled": found.settled,
        "settling": found.reason or None,
    }
    for key in MEDIAN_METRICS:
        summary[key] = _median(s.get(key) for s in measured)
    summary["peak_mem_gib"] = _maximum(s.get("peak_mem_gib") for s in measured)
    summary.update(imbalance_summary(measured))
    return summary


def imbalance_summary(measured: list[dict]) -> dict:
    """Medians of the measured steps' `expert_imbalance` and `rank_imbalance` (the busiest
    expert's and EP rank's tokens over the mean); {} for a trainer that prints none."""
    return {
        key: _median(s.get(key) for s in measured)
        for key in IMBALANCE_METRICS
        if any(s.get(key) is not None for s in measured)
    }


def step_record(sample: dict) -> dict:
    """A parsed contract line as stored: the known keys first, any extra keys kept."""
    known = {key: sample.get(key) for key in STEP_KEYS}
    extra = {k: v for k, v in sample.items() if k not in STEP_KEYS and k != "max_steps"}
    return {**known, **extra}


def now_iso() -> str:
    return datetime.now(timezone.utc).astimezone().isoformat(timespec="milliseconds")


def _installed_version(package: str) -> str | None:
    # Read from the installed metadata: importing torch in the runner would cost seconds.
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(trainer_env: dict | None, world_size: int) -> dict:
    """Host and versions; CUDA, NCCL and devices come from the trainer's `env` line."""
    trainer_env = trainer_env or {}
    return {
        "host": socket.gethostname(),
        "date": now_iso(),
        "python": platform.python_version(),
        "torch": trainer_env.get("torch") or _installed_version("torch"),
        "cuda": trainer_env.get("cuda"),
        "nccl": trainer_env.get("nccl"),
        "devices": list(trainer_env.get("devices") or []),
        "world_size": int(trainer_env.get("world_size") or world_size),
        "trainer_env": trainer_env,
    }


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


def write_record(path: Path, record: dict) -> None:
    """Written whole or not at all (a reader never sees half a file), as strict JSON."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(strict_json(record) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_record(path: Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def flatten(node: object, prefix: str = "") -> dict:
    """{"training.seed": 1, ...}: a nested config as dotted keys."""
    if isinstance(node, dict):
        flat: dict = {}
        for key, value in node.items():
            flat.update(flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: node}


def config_differences(configs: dict[str, dict]) -> list[dict]:
    """[{key, values: {label: value}}] for every dotted key whose value differs between the
    labelled configs, the identity keys (arm, repeat) excepted. Values are compared as JSON, so
    1 and 1.0 or a list and a tuple of the same items count as equal."""
    flats = {
        label: flatten({k: v for k, v in (config or {}).items() if k not in ARM_KEYS})
        for label, config in configs.items()
    }
    keys = sorted(set().union(*flats.values())) if flats else []
    differences = []
    for key in keys:
        values = {label: flat.get(key, "<missing>") for label, flat in flats.items()}
        if len({json.dumps(v, sort_keys=True, default=str) for v in values.values()}) > 1:
            differences.append({"key": key, "values": values})
    return differences


# What each key of an arm record holds (schema moe_perf.arm/2); `None` allowed where listed.
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


def record_problems(record: object) -> list[str]:
    """Why `record` is not an arm record of a schema this code reads ([] when it is one): the
    keys the comparison reads, with their types, and each step's number and metrics."""
    if not isinstance(record, dict):
        return [f"the file holds a JSON {type(record).__name__}, not an object"]
    schema = record.get("schema")
    if schema not in SCHEMAS_READ:  # a later version's record included: its summary may differ
        return [f"schema {schema!r} is not one this moe_perf reads ({', '.join(SCHEMAS_READ)})"]
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
    for i, step in enumerate(record.get("steps") if isinstance(record.get("steps"), list) else []):
        if not isinstance(step, dict):
            problems.append(f"steps[{i}] is not an object")
            continue
        problems += filter(None, [_type_problem(f"steps[{i}].step", step.get("step"), (int,),
                                                False)])  # fmt: skip
        problems += filter(None, (_type_problem(f"steps[{i}].{key}", step.get(key), _NUMBER, True)
                                  for key in METRICS))  # fmt: skip
    summary = record.get("summary") if isinstance(record.get("summary"), dict) else {}
    problems += filter(None, (_type_problem(f"summary.{key}", value,
                                            *SUMMARY_TYPES.get(key, (_NUMBER, True)))
                              for key, value in summary.items()))  # fmt: skip
    return problems


def _read_as_current(record: dict) -> dict:
    """An older record's summary recomputed from its steps by today's rule (a /1 summary
    dropped step 1 alone); `summary_recomputed` says so. Without steps it stays as written."""
    if record["schema"] != SCHEMA and record["steps"]:
        record["summary"] = summarize(record["steps"])
        record["summary_recomputed"] = f"from the steps of a {record['schema']} record"
    return record


def load_record(path: Path) -> tuple[dict | None, str | None]:
    """(record, None) for a readable arm record, else (None, why it was skipped)."""
    try:
        record = read_record(path)
    except (OSError, ValueError) as exc:
        return None, f"skipped {path}: unreadable ({exc})"
    problems = record_problems(record)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        return None, f"skipped {path}: not a {SCHEMA} record: {'; '.join(problems[:3])}{more}"
    record["_path"] = str(path)
    return relocated(_read_as_current(record), Path(path).parent), None


def failed_in_build(record: dict) -> bool:
    """The arm never launched: its commit's build (trainer.build) failed, or was refused for
    changing the shared environment. A bisect skips such a commit, as `git bisect skip` does."""
    return (record.get("build") or {}).get("status") in ("failed", "refused")


def relocated(record: dict, arm_dir: Path) -> dict:
    """The record's own paths (`arm_dir`, `log`) where it is read from now: an earlier sweep
    moved to previous/<id>/ keeps the paths it was written with."""
    written, now = record.get("arm_dir"), arm_dir.resolve()
    if not written or Path(written) == now:
        return record
    record["arm_dir"] = str(now)
    log = record.get("log")
    if log and Path(log).parent == Path(written):
        record["log"] = str(now / Path(log).name)
    return record


def arm_record(
    *,
    config: dict,
    sweep_id: str,
    arm_dir: Path,
    sha: str,
    exit_code: int | None,
    failure: str | None,
    steps: list[dict],
    trainer_env: dict | None,
    started: str,
    wall_time_s: float,
    trainer_wall_s: float,
    extra: dict | None = None,
) -> dict:
    """The metrics.json of one arm (schema SCHEMA)."""
    stored_steps = [step_record(s) for s in steps]
    world = int(config["mesh"]["nnodes"]) * int(config["mesh"]["nproc_per_node"])
    return {
        "schema": SCHEMA,
        "sweep_id": sweep_id,
        "model": config["model"]["name"],
        "tag": config["tag"],
        "arm": config["arm"]["name"],
        "repeat": config["repeat"],
        "ref": config["arm"]["ref"],
        "sha": sha,
        "status": "ok" if failure is None else "failed",
        "exit_code": exit_code,
        "failure": failure,
        "arm_dir": str(arm_dir),
        "log": str(arm_dir / "console.log"),
        "started": started,
        "finished": now_iso(),
        "wall_time_s": round(wall_time_s, 3),
        "trainer_wall_s": trainer_wall_s,
        "steps": stored_steps,
        "summary": summarize(stored_steps),
        "environment": environment(trainer_env, world),
        **(extra or {}),
        "config": config,
    }
