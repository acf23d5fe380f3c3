"""Hydra callback: compare the arms when a multirun sweep ends.

Registered in conf/config.yaml as::

    hydra:
      callbacks:
        compare:
          _target_: moe_perf.runner.callback.CompareCallback

Hydra gives `on_multirun_end` no job results, so the records are read back from the sweep
directory (REFERENCE §7). Hydra also turns a callback's exception into a warning that is easy
to miss, so nothing here raises: a failure is printed as one clear line, with the command
that re-runs the comparison by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf


def sweep_dir_of(config: DictConfig) -> Path:
    """The sweep directory as an absolute path (a relative one is relative to the launch cwd)."""
    sweep_dir = Path(str(config.hydra.sweep.dir))
    if sweep_dir.is_absolute():
        return sweep_dir
    cwd = OmegaConf.select(config, "hydra.runtime.cwd", default=None)
    return (Path(cwd) if cwd else Path.cwd()) / sweep_dir


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
            sweep_dir = sweep_dir_of(config)
            # Imported here: the comparison pulls in matplotlib, which the jobs never need.
            from moe_perf.report.comparison import compare_sweep

            _, text = compare_sweep(sweep_dir, write=self.write)
            print("\n" + text, end="", flush=True)
            if self.write:
                print(f"[moe_perf] comparison written to {sweep_dir}/comparison.md", flush=True)
        except Exception as exc:  # a callback must never fail the sweep: say why, plainly
            where = sweep_dir if sweep_dir is not None else "<sweep dir>"
            print(
                f"[moe_perf] could not compare the sweep ({type(exc).__name__}: {exc}); "
                f"the arms' records are untouched. Retry with: python -m moe_perf.compare {where}",
                file=sys.stderr,
                flush=True,
            )

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        """Nothing: each arm writes its own record; comparing waits for the sweep's end."""
