"""`python -m moe_perf.compare ...`: the comparison's command line (moe_perf.report.cli)."""

import sys

from moe_perf.runner import compile_cache

compile_cache.keep_runner_bytecode()  # before the comparison's imports (scipy, matplotlib)

from moe_perf.report.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
