"""`python -m moe_perf ...` is the `moe-perf` command (the Hydra app lives in moe_perf.cli)."""

from moe_perf.cli import main

if __name__ == "__main__":
    main()
