"""The record of an arm (metrics.json), the comparison of a sweep, its rendering, the
`python -m moe_perf.compare` command."""
