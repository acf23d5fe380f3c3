"""One sweep's state on disk, `<sweep dir>/.moe_perf/sweep.json`: its id and the refs it resolved.

A sweep is one `python -m moe_perf ... -m ...` (or one single run). Its first job resolves both
refs to SHAs and writes `<sweep dir>/.moe_perf/sweep.json`; every later job (in this process or,
under a launcher that forks, another one) reads the SHAs from there, so the feat arm runs the
commit that was checked out when the sweep started even if the user switches branch meanwhile.

Earlier sweeps are kept, never mixed in: each record carries `sweep_id`, and the comparison
reads only the records of the sweep this file names.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from moe_perf.report.results.files import write_json

STATE_DIR = ".moe_perf"
# earlier sweeps, each a sweep directory of its own: <sweep dir>/previous/<sweep_id>/
PREVIOUS = "previous"


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
    write_json(path, asdict(sweep))


def _read(sweep_dir: Path) -> dict | None:
    try:
        state = json.loads(state_path(sweep_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def load(sweep_dir: Path) -> Sweep | None:
    """The sweep a job joins; None when there is none (or the file is not a whole state)."""
    try:
        return Sweep(**(_read(sweep_dir) or {}))
    except TypeError:
        return None


def current_sweep_id(sweep_dir: Path) -> str | None:
    """The id of the sweep the directory's state names: the records a comparison reads."""
    sweep_id = (_read(sweep_dir) or {}).get("sweep_id")
    return str(sweep_id) if sweep_id else None


def find_sweep(sweep_dir: Path, sweep_id: str) -> Path:
    """The directory of sweep `sweep_id`: the sweep directory itself when it is the current
    sweep, else the earlier sweep kept in `previous/<sweep_id>/`."""
    sweep_dir = Path(sweep_dir)
    if current_sweep_id(sweep_dir) == sweep_id:
        return sweep_dir
    kept = sweep_dir / PREVIOUS / sweep_id
    if kept.is_dir():
        return kept
    earlier = sorted(p.name for p in (sweep_dir / PREVIOUS).glob("*") if p.is_dir())
    known = ", ".join(([current_sweep_id(sweep_dir)] if current_sweep_id(sweep_dir) else [])
                      + earlier) or "none"  # fmt: skip
    raise ValueError(f"no sweep {sweep_id} in {sweep_dir} (sweeps there: {known})")


# ---- the verdict's plan: how the sweep looked at its pairs -------------------------------------

PLAN_FILE = "plan.json"


def save_plan(sweep_dir: Path, data: dict) -> None:
    """`<sweep dir>/.moe_perf/plan.json`: the decision plan and each cell's pairs so far, so the
    comparison at the end computes the verdict exactly as the sweep did while it ran."""
    path = Path(sweep_dir) / STATE_DIR / PLAN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, data)


def load_plan(sweep_dir: Path) -> dict | None:
    """The sweep's plan (`save_plan`), or None for a sweep that wrote none."""
    try:
        data = json.loads((Path(sweep_dir) / STATE_DIR / PLAN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("plan"), dict) else None
