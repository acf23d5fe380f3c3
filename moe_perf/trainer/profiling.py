"""torch.profiler for the trainer: the last measured steps (trainer.profile_steps) and the extra
steps explain=true profiles after them (trainer.explain_steps)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch


def start_profiler(device: torch.device) -> torch.profiler.profile:
    """torch.profiler with CPU activities, and CUDA ones on a GPU, started."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities)
    prof.start()
    return prof


def output_dir(tcfg, default) -> Path:
    """Where the trainer's profiles go: trainer.profile_dir, else `default` (the arm's
    `profile` folder), else ./profile."""
    return Path(tcfg.profile_dir or default or "profile")


class Profiler:
    """torch.profiler over the last `trainer.profile_steps` steps; writes, per rank,
    `kernels_rank<r>.txt` (ops by device time) and `trace_rank<r>.json` (Chrome trace).

    The profiled steps are still timed and printed; tracing costs a little host time per op,
    so read their step times with that in mind (bench/profile_summary.py reads the trace).
    """

    def __init__(self, tcfg, max_steps: int, device: torch.device, rank: int, out_dir):
        n = min(tcfg.profile_steps, max_steps)
        self.first = max_steps - n + 1 if n > 0 else None
        self.last = max_steps
        self.device, self.rank = device, rank
        self.out_dir = output_dir(tcfg, out_dir)
        self.prof = None
        self.span = None

    def before_step(self, step: int) -> None:
        if step == self.first:
            self.prof = start_profiler(self.device)
        if self.prof is not None:
            # one span per profiled step, as in `profile_steps`: a trace without them is one
            # block whose length the busiest thread's ops decide (on a GPU the backward's
            # thread: a 27 ms "step" of a 500 ms one, its idle share meaningless)
            self.span = torch.profiler.record_function(f"ProfilerStep#{step - self.first}")
            self.span.__enter__()

    def after_step(self, step: int) -> None:
        if self.prof is None:
            return
        self.span.__exit__(None, None, None)
        if step != self.last:
            return
        self.prof.stop()
        out = self.out_dir
        out.mkdir(parents=True, exist_ok=True)
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = self.prof.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=90)
        (out / f"kernels_rank{self.rank}.txt").write_text(table + "\n")
        self.prof.export_chrome_trace(str(out / f"trace_rank{self.rank}.json"))
        self.prof = None


def profile_steps(step_fn: Callable[[int], float], steps: int, device, trace: Path) -> list:
    """Run `step_fn(i)` (one training step, returning its timed wall time in s) for i < `steps`
    under torch.profiler; write the Chrome trace to `trace` (one `ProfilerStep#i` span per
    step) and return the wall times."""
    wall_s = []
    prof = start_profiler(device)
    for i in range(steps):
        with torch.profiler.record_function(f"ProfilerStep#{i}"):
            wall_s.append(step_fn(i))
    prof.stop()
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    return wall_s
