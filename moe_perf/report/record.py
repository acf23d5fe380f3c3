"""One arm's record, `metrics.json` (schema `moe_perf.arm/2`): per-step samples, the summary,
the arm's commit, its exit status and the environment. Humans get a table (compare.py);
machines get this file, read from Python as a typed `ArmRecord` (moe_perf/report/results/).

This module builds the record when an arm ends (`arm_record`), reads one back (`load_record`,
a reason instead for a file that is none) and holds the identity rule: the config keys that
may differ between the arms of one comparison.

`summarize(steps)` is the summary rule (`Summary.of`) over plain step dicts: step 1 dropped,
then the leading steps still settling, medians of the rest, peak memory as their maximum.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import socket
from datetime import datetime, timezone
from pathlib import Path

from moe_perf.report.results.arm import ArmRecord, RecordError, Step, Summary
from moe_perf.report.results.checks import SCHEMA

ARMS = ("base", "feat")
# The identity rule: the only keys allowed to differ between the arms of one comparison.
ARM_KEYS = ("arm", "repeat")


def summarize(steps: list[dict]) -> dict:
    """The summary (as metrics.json holds it) of steps as parsed or stored."""
    return Summary.of([Step.from_dict(s) for s in steps]).to_dict()


def step_record(sample: dict) -> Step:
    """A parsed contract line as stored: the known keys first, any extra keys kept."""
    return Step.from_dict({k: v for k, v in sample.items() if k != "max_steps"})


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


def load_record(path: Path) -> tuple[ArmRecord | None, str | None]:
    """(record, None) for a readable arm record, else (None, why it was skipped)."""
    try:
        return ArmRecord.load(path), None
    except RecordError as exc:
        return None, f"skipped {exc}"


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
) -> ArmRecord:
    """The record of one arm (schema SCHEMA), as its metrics.json will hold it."""
    stored_steps = tuple(step_record(s) for s in steps)
    world = int(config["mesh"]["nnodes"]) * int(config["mesh"]["nproc_per_node"])
    return ArmRecord(
        schema=SCHEMA,
        sweep_id=sweep_id,
        model=config["model"]["name"],
        tag=config["tag"],
        arm=config["arm"]["name"],
        repeat=config["repeat"],
        ref=config["arm"]["ref"],
        sha=sha,
        status="ok" if failure is None else "failed",
        exit_code=exit_code,
        failure=failure,
        arm_dir=str(arm_dir),
        log=str(arm_dir / "console.log"),
        started=started,
        finished=now_iso(),
        wall_time_s=round(wall_time_s, 3),
        trainer_wall_s=trainer_wall_s,
        steps=stored_steps,
        summary=Summary.of(stored_steps),
        environment=environment(trainer_env, world),
        config=config,
        extra=dict(extra or {}),
    )
