"""Typed results, read and written as versioned JSON: an arm's record (`ArmRecord`, with its
`Step`s and `Summary`) and a sweep's comparison (`Comparison`)."""

from moe_perf.report.results.arm import ArmRecord, RecordError, Step, Summary
from moe_perf.report.results.comparison import (
    ArmFigures,
    Comparison,
    ComparisonError,
    Difference,
    Group,
    Run,
    Spread,
)

__all__ = ["ArmFigures", "ArmRecord", "Comparison", "ComparisonError", "Difference", "Group",
           "RecordError", "Run", "Spread", "Step", "Summary"]  # fmt: skip
