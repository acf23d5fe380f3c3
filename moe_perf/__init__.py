"""moe_perf: run the same short MoE training on a base and a feature branch, compare step time.

The package root imports nothing: the trainer's worker processes (`python -m moe_perf.trainer`)
import this file too, and must not pay for (or depend on) Hydra. The runner's entry point is
`moe_perf.runner.app`; the schema and resolvers register when `moe_perf.runner.schema` is imported.
"""

__version__ = "0.1.0"
