"""`python -m moe_perf ...`: the `moe-perf` command (the Hydra app is moe_perf.runner.app)."""

from moe_perf.runner import compile_cache

compile_cache.keep_runner_bytecode()  # before the runner's own imports
compile_cache.start_bytecode_pool()  # the arms' bytecode pool, started now (MOE_PERF_BYTECODE_POOL)

from moe_perf.runner.app import main  # noqa: E402

if __name__ == "__main__":
    main()
