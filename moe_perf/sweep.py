"""One sweep's state on disk: its id, the refs it resolved, and the arm directories.

A sweep is one `python -m moe_perf ... -m ...` (or one single run). Its first job resolves both
refs to SHAs and writes `<sweep dir>/.moe_perf/sweep.json`; every later job (in this process or,
under a launcher that forks, another one) reads the SHAs from there, so the feat arm runs the
commit that was checked out when the sweep started even if the user switches branch meanwhile.

Earlier sweeps are kept, never mixed in: each record carries `sweep_id`, and an arm directory
left by an earlier sweep is moved to `<model>/previous/<its sweep_id>/<name>` before reuse.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from moe_perf import records

STATE_DIR = ".moe_perf"


@dataclass
class Sweep:
    sweep_id: str
    sweep_dir: str
    repo: str
    refs: dict  # {"base": "main", "feat": "my-branch"}: as asked, when the sweep started
    shas: dict  # {"base": "<40 hex>", "feat": "<40 hex>"}
    started: str

    @property
    def aa_run(self) -> bool:
        return self.shas["base"] == self.shas["feat"]


def new_sweep_id() -> str:
    """A timestamp (sorts by start time) with the pid (two hosts, one second)."""
    return datetime.now().strftime("%Y%m%d-%H%M%S-%f")[:-3] + f"-{os.getpid()}"


def state_path(sweep_dir: Path) -> Path:
    return Path(sweep_dir) / STATE_DIR / "sweep.json"


def save(sweep: Sweep) -> None:
    path = state_path(Path(sweep.sweep_dir))
    path.parent.mkdir(parents=True, exist_ok=True)
    records.write_record(path, asdict(sweep))


def load(sweep_dir: Path) -> Sweep | None:
    try:
        return Sweep(**json.loads(state_path(sweep_dir).read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None


# ---- arm directories -------------------------------------------------------------------------


def _sweep_id_of(arm_dir: Path) -> str:
    try:
        return str(records.read_record(arm_dir / "metrics.json").get("sweep_id") or "unknown")
    except (OSError, ValueError):
        # an arm that never finished writing its record (interrupted): name it by its time
        stamp = datetime.fromtimestamp(arm_dir.stat().st_mtime).strftime("%Y%m%d-%H%M%S")
        return f"unfinished-{stamp}"


def move_aside(arm_dir: Path) -> Path | None:
    """Moves an earlier run's arm directory to `<parent>/previous/<sweep_id>/<name>`."""
    if not arm_dir.is_dir() or not any(arm_dir.iterdir()):
        return None
    target = arm_dir.parent / "previous" / _sweep_id_of(arm_dir) / arm_dir.name
    suffix = 1
    while target.exists():  # the same earlier sweep ran this arm twice
        target = target.with_name(f"{arm_dir.name}.{suffix}")
        suffix += 1
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(arm_dir), str(target))
    return target


def remove_empty_dirs(path: Path, stop: Path) -> None:
    """Removes `path` and its parents while they are empty, up to (not including) `stop`."""
    path, stop = path.resolve(), stop.resolve()
    while path != stop and stop in path.parents:
        try:
            path.rmdir()
        except OSError:
            return  # not empty, or gone
        path = path.parent


# ---- arm identity ----------------------------------------------------------------------------

ARM_KEYS = ("arm", "repeat")  # the only keys allowed to differ between arms of one comparison


def _flatten(node: object, prefix: str = "") -> dict:
    if isinstance(node, dict):
        flat: dict = {}
        for key, value in node.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: node}


def differing_keys(first: dict, other: dict) -> list[str]:
    """Dotted keys whose values differ (arm and repeat excepted), e.g. `training.seed (1 vs 2)`."""
    a = _flatten({k: v for k, v in first.items() if k not in ARM_KEYS})
    b = _flatten({k: v for k, v in other.items() if k not in ARM_KEYS})
    return [
        f"{key} ({a.get(key, '<missing>')!r} vs {b.get(key, '<missing>')!r})"
        for key in sorted(set(a) | set(b))
        if a.get(key, "<missing>") != b.get(key, "<missing>")
    ]


def check_identity(sweep: Sweep, model: str, tag: str, arm_label: str, config: dict) -> str | None:
    """The first arm of (model, tag) in this sweep records its config; later arms must match.

    Returns None when this arm may run, else why not (the differing keys).
    """
    path = Path(sweep.sweep_dir) / STATE_DIR / "identity" / model / f"{tag}.json"
    if path.exists():
        first = records.read_record(path)
        if first.get("sweep_id") == sweep.sweep_id:
            keys = differing_keys(first["config"], config)
            if not keys:
                return None
            return (
                f"config differs from arm {first['arm']} of this comparison in "
                f"{'; '.join(keys)}: only arm and repeat may differ between arms"
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    records.write_record(path, {"sweep_id": sweep.sweep_id, "arm": arm_label, "config": config})
    return None
