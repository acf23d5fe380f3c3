"""What the runner writes beside the arms: the outputs' .gitignore, earlier arm directories
moved aside, the identity of the arms of one comparison.

An arm directory left by an earlier sweep is moved to `<model>/previous/<its sweep_id>/<name>`
before reuse, so no measurement is overwritten.
"""

from __future__ import annotations

import shutil
from datetime import datetime
from pathlib import Path

from moe_perf.report import record as records
from moe_perf.report.sweep import STATE_DIR, Sweep
from moe_perf.runner import git


def ignore_outputs(repo: Path, sweep_dir: Path) -> None:
    """Outputs inside the repository must not dirty its tree for the next sweep."""
    try:
        rel = sweep_dir.resolve().relative_to(repo)
    except ValueError:
        return  # outside the repository
    if not rel.parts or git.is_ignored(repo, rel / "metrics.json"):
        return
    root = repo / rel.parts[0]
    target = root / ".gitignore" if not (root / ".gitignore").exists() else sweep_dir / ".gitignore"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("# written by moe_perf: run outputs are not source\n*\n")


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


def differing_keys(first: dict, other: dict) -> list[str]:
    """Dotted keys whose values differ (arm and repeat excepted), e.g. `training.seed (1 vs 2)`."""
    return [
        f"{d['key']} ({d['values']['first']!r} vs {d['values']['other']!r})"
        for d in records.config_differences({"first": first, "other": other})
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
