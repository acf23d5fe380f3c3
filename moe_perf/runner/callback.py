"""Hydra callback: compare the arms when a multirun sweep ends.

Registered in conf/config.yaml as::

    hydra:
      callbacks:
        compare:
          _target_: moe_perf.runner.callback.CompareCallback

Hydra gives `on_multirun_end` no job results, so the records are read back from the sweep
directory. Hydra also turns a callback's exception into a warning that is easy to miss, so
nothing here raises: a failure is printed as one clear line, with the command that re-runs the
comparison by hand. The one deliberate exit is SystemExit(3) once everything is printed and
written, when an arm of the sweep failed (Hydra lets SystemExit through: the command's exit code).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from moe_perf.common.errors import ARM_FAILED
from moe_perf.report.results.comparison import Comparison
from moe_perf.runner.hydra_jobs import sweep_dir_of
from moe_perf.runner.session import end_sweep


def written_files(report: Comparison, sweep_dir: Path) -> list[str]:
    """What the sweep left in its directory, one line per place: the comparison, the sweep's
    state, and each arm's directory with its entries (`torchrun/`, `wandb/` are folders)."""
    top = sorted(p.name for p in [*sweep_dir.glob("comparison*"), *sweep_dir.glob("explain.png")])
    top += ["multirun.yaml"] if (sweep_dir / "multirun.yaml").exists() else []
    state = sweep_dir / ".moe_perf"  # the sweep's refs -> SHAs, the arms' identity records
    top += sorted(f".moe_perf/{e.name}" + ("/" if e.is_dir() else "") for e in state.glob("*"))
    lines = [f"  {sweep_dir}/  {' '.join(top)}"]
    for group in report.groups:
        for run in group.runs:
            arm_dir = Path(run.metrics_json).parent if run.metrics_json else None
            if arm_dir is None or not arm_dir.is_dir():
                continue
            entries = sorted(e.name + ("/" if e.is_dir() else "") for e in arm_dir.iterdir())
            shown = arm_dir.relative_to(sweep_dir) if arm_dir.is_relative_to(sweep_dir) else arm_dir
            lines.append(f"  {shown}/  {' '.join(entries)}")
    return lines


class CompareCallback(Callback):
    """Prints (and writes into the sweep dir) the comparison of every arm of the sweep."""

    def __init__(self, write: bool = True) -> None:
        self.write = write

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = None
        if OmegaConf.select(config, "dry_run", default=False):
            print("[moe_perf] dry run: nothing was launched, so there is nothing to compare",
                  flush=True)  # fmt: skip
            return
        try:
            sweep_dir = sweep_dir_of(config.hydra)
            end_sweep(sweep_dir)  # the sweep's worktrees go, with what was built in them
            # Imported here: the comparison pulls in matplotlib, which the jobs never need.
            from moe_perf.report.comparison import compare_sweep
            from moe_perf.report.render import verdict

            report, text = compare_sweep(sweep_dir, write=self.write)
            print("\n" + text, end="", flush=True)
            if self.write:
                print("[moe_perf] files written:", flush=True)
                print("\n".join(written_files(report, sweep_dir)), flush=True)
            self.log_verdicts(report, config, sweep_dir)
            for group in report.groups:  # the sweep's last lines: one verdict per (model, tag)
                print(f"[moe_perf] {verdict(group)}", flush=True)
            failed = report.failed_runs
        except Exception as exc:  # a callback must never fail the sweep: say why, plainly
            where = sweep_dir if sweep_dir is not None else "<sweep dir>"
            print(
                f"[moe_perf] could not compare the sweep ({type(exc).__name__}: {exc}); "
                f"the arms' records are untouched. Retry with: python -m moe_perf.compare {where}",
                file=sys.stderr,
                flush=True,
            )
            return
        if failed:
            print(f"[moe_perf] {len(failed)} run(s) of this sweep failed: exit code {ARM_FAILED}",
                  file=sys.stderr, flush=True)  # fmt: skip
            raise SystemExit(ARM_FAILED)

    def log_verdicts(self, report: Comparison, config: DictConfig, sweep_dir: Path) -> None:
        wandb_cfg = OmegaConf.select(config, "wandb")
        if not self.write or str(OmegaConf.select(config, "wandb.mode")) == "disabled":
            return
        from moe_perf.runner.wandb_log import log_verdict  # wandb only where it is used

        for group in report.groups:  # logged as comparison.json holds it
            log_verdict(group.to_dict(), sweep_dir / ".moe_perf", wandb_cfg)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        """Nothing: each arm writes its own record; comparing waits for the sweep's end."""
