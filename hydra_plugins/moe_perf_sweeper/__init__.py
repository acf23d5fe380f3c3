"""moe_perf's Hydra sweeper plugin: base/feat pairs, added until decided (moe_perf/runner/pairs.py).

Hydra only instantiates sweepers whose class lives under `hydra_plugins`; this one is the app's
default (`hydra/sweeper: moe_perf` in conf/config.yaml), registered by `moe_perf.runner.app`.
"""
