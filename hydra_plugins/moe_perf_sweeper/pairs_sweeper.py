"""`hydra/sweeper=moe_perf`: every arm one Hydra job, base/feat pairs added until decided.

Hydra's Optuna and Ax sweepers also choose their next jobs from the results of the last ones;
this one does it for a step-time verdict. The planning, the order (ABBA), the stopping rule
and the console lines are moe_perf.runner.pairs; this class only connects them to Hydra: it
parses the sweep's overrides, writes multirun.yaml as the basic sweeper does, launches each
pair through the configured launcher (basic, or moe_perf_slurm) and hands back the arm
directories of the jobs it ran.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from moe_perf.runner import pairs
from moe_perf.runner.hydra_jobs import sweep_dir_of
from moe_perf.runner.job import say


class PairsSweeper(Sweeper):
    def __init__(self, max_batch_size: int | None = None,
                 params: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__()
        self.params = dict(params or {})
        self.job_index = 0
        self.hydra_context: HydraContext | None = None
        self.config: DictConfig | None = None
        self.launcher = None
        self.returns: list[Sequence[JobReturn]] = []

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:  # fmt: skip
        from hydra.core.plugins import Plugins

        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> Any:
        assert self.config is not None and self.hydra_context is not None
        given = [f"{k}={v}" for k, v in self.params.items()] + list(arguments)
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        try:
            sweep_plan = pairs.plan_of(given, parser)
        except ValueError as err:
            say(f"cannot run: {err}", sys.stderr)
            raise SystemExit(2) from None
        compare = self.config.compare
        plan = plan_for(sweep_plan, compare)
        # as the basic sweeper does (a dry run's is put back by the sweep's DryRunGuard): the
        # jobs read the sweep's arguments from it
        sweep_dir = sweep_dir_of(self.config.hydra)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        if self.config.get("dry_run"):
            return self.dry_run(sweep_plan, plan)
        max_minutes = compare.get("max_minutes")
        pairs.PairSweep(sweep_plan, plan, self.launch, say, sweep_dir, max_minutes).run()
        return self.returns

    def dry_run(self, sweep_plan: pairs.SweepPlan, plan) -> Any:
        """Each distinct arm once (what it would run), writing nothing; then what the sweep
        would repeat."""
        # one pair per cell: pair 0 of an auto sweep, or the first of fixed repeats
        first = sweep_plan.repeats[:1] if sweep_plan.repeats else None
        once = pairs.SweepPlan(sweep_plan.cells, sweep_plan.arms, first)
        for batch in pairs.fixed_batches(once):
            self.launch(batch)
        say(pairs.dry_run_note(sweep_plan, plan))
        return self.returns

    def launch(self, batch: list[list[str]]) -> list[Path | None]:
        self.validate_batch_is_legal(batch)
        results = self.launcher.launch(batch, initial_job_idx=self.job_index)
        self.job_index += len(batch)
        self.returns.append(results)
        for result in results:
            _ = result.return_value  # a job that raised re-raises here, as in the basic sweeper
        return [arm_dir_of(result) for result in results]


def plan_for(sweep_plan: pairs.SweepPlan, compare: Any) -> Any:
    if sweep_plan.auto:
        return pairs.plan_from_config(compare, sequential=True)
    return pairs.plan_from_config(compare, sequential=False,
                                  max_pairs=len(sweep_plan.repeats or (0,)))  # fmt: skip


def arm_dir_of(result: JobReturn) -> Path | None:
    output_dir = OmegaConf.select(result.hydra_cfg or {}, "hydra.runtime.output_dir")
    return Path(output_dir) if output_dir else None
