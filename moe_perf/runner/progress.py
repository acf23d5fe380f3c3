"""What the console says while a sweep runs: which arm of how many, why nothing prints yet,
and how many threads each rank gets. Each step's line, as the arm's log is read, is
moe_perf/logs/progress.py's. Pure Python and stateless.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# ---- threads per rank ------------------------------------------------------------------------


@dataclass(frozen=True)
class RankThreads:
    """OMP_NUM_THREADS for each rank of one launch, and where that number came from.

    torchrun sets 1 thread per rank on its own, with a four-line banner, whenever more than one
    process starts and OMP_NUM_THREADS is unset. moe_perf sets it instead, to the cores this
    process may use less one (the runner reads every line the ranks print) divided by the ranks
    on this node, at least 1; an OMP_NUM_THREADS in the environment is kept. On a 2-core VM a
    single rank with 2 threads ran A/A pairs 21-23% apart (each process settling at 0.62 or
    0.80 s per step); with 1 thread, 2%.
    """

    threads: int
    cores: int
    ranks: int
    from_environment: bool

    @classmethod
    def for_launch(cls, nproc_per_node: int) -> RankThreads:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        cores, ranks = cores or 1, max(1, int(nproc_per_node))
        given = os.environ.get("OMP_NUM_THREADS", "")
        if given.isdigit() and int(given) > 0:
            return cls(int(given), cores, ranks, from_environment=True)
        return cls(max(1, (cores - 1) // ranks), cores, ranks, from_environment=False)

    @property
    def env(self) -> dict[str, str]:
        return {} if self.from_environment else {"OMP_NUM_THREADS": str(self.threads)}

    def describe(self) -> str:
        ranks = f"{self.ranks} rank{'s' if self.ranks > 1 else ''}"
        if self.from_environment:
            return f"{ranks}, OMP_NUM_THREADS={self.threads} each (from your environment)"
        return (f"{ranks}, OMP_NUM_THREADS={self.threads} each ({self.cores} cores - 1 for "
                f"the runner, / {self.ranks}; set OMP_NUM_THREADS to choose)")  # fmt: skip


# ---- the arm's first lines -------------------------------------------------------------------


def arm_count(num: int, total: int | None) -> str:
    """`arm 2/4` in a sweep whose jobs are known, `arm 2` otherwise."""
    return f"arm {num + 1}/{total}" if total else f"arm {num + 1}"


def starting_line(label: str, threads: RankThreads, compiled: bool, torchrun: bool = True) -> str:
    """Why the next minute may be silent: start-up, model build and the first step."""
    first = "the first step compiles" if compiled else "the first step warms up"
    how = "torchrun with" if torchrun else "one process, no torchrun:"
    return (f"{label}: starting: {how} {threads.describe()}; trainer start-up, model "
            f"build and {first} before step 1 prints")  # fmt: skip
