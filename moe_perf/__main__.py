"""`python -m moe_perf ...`: the `moe-perf` command (the Hydra app is moe_perf.runner.app)."""

from moe_perf.runner.app import main

if __name__ == "__main__":
    main()
