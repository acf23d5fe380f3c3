"""`python -m moe_perf.compare ...`: the comparison's command line (moe_perf.report.cli)."""

import sys

from moe_perf.report.cli import main

if __name__ == "__main__":
    sys.exit(main())
