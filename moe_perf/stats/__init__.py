"""Statistics of run medians: the verdict's decision rule, its simulation, the steady-state rule.

Pure (numpy and scipy only): no Hydra, no torch, no files. The runner and the report import it.
"""
