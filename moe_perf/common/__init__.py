"""Pure Python shared by the runner and the trainer: mesh arithmetic, the trainer contract,
the corpus layout, the config dataclasses. Imports nothing else of moe_perf."""
