"""What the runner writes beside the arms, and what it refuses to touch.

The sweep directory (`outputs/validate-performance` unless hydra.sweep.dir says otherwise)
holds only what moe_perf and Hydra write there: `SWEEP_FILES` at its top, `<model>/<arm dir>/`
below, `previous/` for earlier sweeps. Anything else in it, and any file of it that git
tracks, is the user's: the sweep refuses to start rather than hide, move or overwrite it.

A new sweep first moves the earlier sweep as a whole (its arm directories, multirun.yaml,
sweep state and comparison) to `previous/<its sweep_id>/`, which is a sweep directory of its
own: `python -m moe_perf.compare <sweep dir> --sweep <id>` rebuilds its comparison.
"""

from __future__ import annotations

import os
import shutil
from datetime import datetime
from pathlib import Path

from moe_perf.common.errors import PrerequisiteError
from moe_perf.report import record as records
from moe_perf.report.results.files import read_json, write_json
from moe_perf.report.sweep import PREVIOUS, STATE_DIR, Sweep, current_sweep_id
from moe_perf.runner import git

GITIGNORE_HEADER = "# written by moe_perf: run outputs are not source"
# the sweep level: Hydra's multirun.yaml, the sweep's state, the comparison
SWEEP_FILES = ("multirun.yaml", STATE_DIR, "comparison.json", "comparison.md", "comparison.png",
               "explain.png")  # fmt: skip
# Hydra's submitit launcher: its jobs' pickles and logs, in use while the sweep runs (never moved)
SUBMITIT_DIR = ".submitit"


def _ours_at_top(path: Path) -> bool:
    if path.name == ".gitignore":
        return path.read_text(errors="replace").startswith(GITIGNORE_HEADER)
    return path.name in (*SWEEP_FILES, SUBMITIT_DIR) or (path.name == PREVIOUS and path.is_dir())


def foreign_files(repo: Path | None, sweep_dir: Path) -> list[Path]:
    """What in the sweep directory moe_perf did not write: files beside its own at the top
    and in a model's directory, and every file of it that git tracks."""
    if not sweep_dir.is_dir():
        return []
    foreign = []
    for top in sorted(sweep_dir.iterdir()):
        if _ours_at_top(top):
            continue
        if not top.is_dir():
            foreign.append(top)
            continue
        # a model's directory: arm directories (whatever a trainer writes inside) and previous/
        foreign += [p for p in sorted(top.iterdir()) if not p.is_dir()]
    if repo is not None and _inside(sweep_dir, repo):
        tracked = git.git(repo, "ls-files", "--", str(sweep_dir.resolve()))
        foreign += [repo / line for line in tracked.splitlines() if line]
    return sorted(set(foreign))


def check_outputs(repo: Path | None, sweep_dir: Path) -> None:
    """Refuses a sweep directory that holds files moe_perf did not write (nothing is written)."""
    foreign = foreign_files(repo, sweep_dir)
    if foreign:
        shown = ", ".join(str(p) for p in foreign[:5])
        more = f", ... ({len(foreign)} in all)" if len(foreign) > 5 else ""
        raise PrerequisiteError(
            f"the sweep directory {sweep_dir} holds files moe_perf did not write ({shown}{more}); "
            f"moe_perf moves earlier sweeps aside there and would hide or move them: move them "
            f"out, or give the sweep another directory (hydra.sweep.dir=...)"
        )


def _inside(path: Path, repo: Path) -> bool:
    try:
        path.resolve().relative_to(repo.resolve())
    except ValueError:
        return False
    return True


def ignore_outputs(repo: Path, sweep_dir: Path) -> None:
    """Outputs inside the repository must not dirty its tree for the next sweep: a `.gitignore`
    of `*` in the sweep directory itself (which holds only moe_perf's files), never above it."""
    if not _inside(sweep_dir, repo) or sweep_dir.resolve() == repo.resolve():
        return
    if git.is_ignored(repo, sweep_dir.resolve() / "metrics.json") or foreign_files(None, sweep_dir):
        return
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / ".gitignore").write_text(f"{GITIGNORE_HEADER}\n*\n")


class DryRunGuard:
    """What a dry run must leave as it found it: Hydra's sweeper writes multirun.yaml into the
    sweep directory (making the directory) before any job runs, over an earlier sweep's.
    Taken before the sweeper runs; `restore` puts the file (content and times) back, or
    removes it and the directories the dry run made."""

    def __init__(self, sweep_dir: Path) -> None:
        self.multirun = sweep_dir / "multirun.yaml"
        self.kept = self.multirun.read_bytes() if self.multirun.is_file() else None
        self.times = self.multirun.stat() if self.kept is not None else None
        made = [p for p in (sweep_dir, *sweep_dir.parents) if not p.exists()]
        self.first_made = made[-1] if made else None  # the outermost directory it will make

    def restore(self) -> None:
        if self.kept is not None:
            self.multirun.write_bytes(self.kept)
            os.utime(self.multirun, ns=(self.times.st_atime_ns, self.times.st_mtime_ns))
            return
        self.multirun.unlink(missing_ok=True)
        if self.first_made is not None:
            remove_empty_dirs(self.multirun.parent, stop=self.first_made.parent)


# ---- earlier sweeps --------------------------------------------------------------------------


def _record_sweep_id(arm_dir: Path) -> str | None:
    try:
        sweep_id = read_json(arm_dir / "metrics.json").get("sweep_id")
    except (OSError, ValueError, AttributeError):
        return None
    return str(sweep_id) if sweep_id else None


def _stamp(path: Path) -> str:
    return datetime.fromtimestamp(path.stat().st_mtime).strftime("%Y%m%d-%H%M%S")


def _move(source: Path, target: Path) -> None:
    suffix = 1
    base = target
    while target.exists():  # the same earlier sweep ran this arm twice
        target = base.with_name(f"{base.name}.{suffix}")
        suffix += 1
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(source), str(target))


def move_earlier_sweeps(sweep_dir: Path) -> dict[str, Path]:
    """Moves everything earlier sweeps left in the sweep directory to `previous/<sweep_id>/`,
    each arm directory to its own record's sweep; {sweep_id: its directory now}."""
    if not sweep_dir.is_dir():
        return {}
    state_id = current_sweep_id(sweep_dir)
    moved: dict[str, Path] = {}

    def target_of(sweep_id: str | None, fallback: Path) -> Path:
        sweep_id = sweep_id or state_id or f"unfinished-{_stamp(fallback)}"
        moved[sweep_id] = sweep_dir / PREVIOUS / sweep_id
        return moved[sweep_id]

    for model in sorted(p for p in sweep_dir.iterdir() if p.is_dir() and not _ours_at_top(p)):
        for arm_dir in sorted(p for p in model.iterdir() if p.is_dir() and p.name != PREVIOUS):
            if any(arm_dir.iterdir()):
                _move(arm_dir, target_of(_record_sweep_id(arm_dir), arm_dir) / model.name /
                      arm_dir.name)  # fmt: skip
    for name in SWEEP_FILES:
        path = sweep_dir / name
        if path.exists():
            _move(path, target_of(state_id, path) / name)
    return moved


def move_aside(arm_dir: Path, sweep_dir: Path) -> Path | None:
    """An arm directory a sweep finds in use (left by an earlier sweep that was not moved as a
    whole): to `previous/<its sweep_id>/<model>/<name>` of the sweep directory."""
    if not arm_dir.is_dir() or not any(arm_dir.iterdir()):
        return None
    sweep_id = _record_sweep_id(arm_dir) or f"unfinished-{_stamp(arm_dir)}"
    target = sweep_dir / PREVIOUS / sweep_id / arm_dir.parent.name / arm_dir.name
    _move(arm_dir, target)
    return target


def remove_empty_dirs(path: Path, stop: Path) -> None:
    """Removes `path` and its parents while they are empty, up to (not including) `stop`."""
    path, stop = path.resolve(), stop.resolve()
    while path != stop and stop in path.parents:
        if path.exists():
            try:
                path.rmdir()
            except OSError:
                return  # not empty
        path = path.parent  # a directory already gone: its parent may still be empty


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
        first = read_json(path)
        if first.get("sweep_id") == sweep.sweep_id:
            keys = differing_keys(first["config"], config)
            if not keys:
                return None
            return (
                f"config differs from arm {first['arm']} of this comparison in "
                f"{'; '.join(keys)}: only arm and repeat may differ between arms"
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"sweep_id": sweep.sweep_id, "arm": arm_label, "config": config})
    return None
