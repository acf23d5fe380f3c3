"""Where the difference comes from: time per step by category for both arms (`explain=true`).

With `explain=true` each arm, after its measured steps, runs a few more steps under
torch.profiler (`trainer.explain_steps`, moe_perf/common/explain.py) and leaves Chrome traces
in `<arm dir>/explain/`. This package reads them and splits each profiled step into categories
(dense GEMM, expert GEMM, attention, all-to-all, ...), one job a module:

* categories.py: the categories and the rules that put an op or a kernel in one;
* traces.py: one trace to milliseconds per profiled step, by category and by name;
* arms.py: each arm's traces found, averaged over ranks, the first profiled step dropped
  (when 3 or more), and its peak memory;
* noise.py: both arms side by side, each category's difference and the noise it is judged
  against (`explain_group`, the comparison's explain section).

The section's Markdown and picture are report/render_explain.py's. The runner never imports
torch: traces are JSON.
"""

from moe_perf.report.explain.arms import TRACE_GLOBS, arm_breakdown, trace_files
from moe_perf.report.explain.categories import CATEGORIES, EXPERT_SCOPE, LABELS, categorize
from moe_perf.report.explain.noise import (
    NOISE_FLOOR,
    NOISE_FLOOR_CPU,
    explain_group,
    noise_floor,
    spread,
)
from moe_perf.report.explain.traces import TraceOp, nest_ops, read_trace, trace_breakdown

__all__ = [
    "CATEGORIES",
    "EXPERT_SCOPE",
    "LABELS",
    "NOISE_FLOOR",
    "NOISE_FLOOR_CPU",
    "TRACE_GLOBS",
    "TraceOp",
    "arm_breakdown",
    "categorize",
    "explain_group",
    "nest_ops",
    "noise_floor",
    "read_trace",
    "spread",
    "trace_breakdown",
    "trace_files",
]
