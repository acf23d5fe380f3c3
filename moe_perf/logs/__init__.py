"""Per-step samples from a trainer's console output, in every format moe_perf reads, brought to
the contract's meaning before anything is recorded or compared. Pure Python: the launchers read
a launch's lines with it as they come, the report reads saved logs.

lines.py cleans and stitches lines; each format is one class behind one interface (base.py:
contract.py, torchtitan.py, megatron.py with NeMo, regex.py for a user's own), named in
formats.py; reader.py keeps the steps and validates them; normalize.py brings them to the
contract's meaning and says how.
"""

from moe_perf.logs.formats import (
    FORMAT_LINES,
    FORMATS,
    UnknownFormat,
    detect_format,
    format_named,
    line_parser,
)
from moe_perf.logs.lines import TeeLines, clean
from moe_perf.logs.reader import LogReader, ParsedLog, parse_lines, parse_log
from moe_perf.logs.regex import REGEX_GROUPS, REGEX_TIMING
from moe_perf.logs.steps import METRIC_KEYS, RunShape

__all__ = [
    "FORMATS",
    "FORMAT_LINES",
    "METRIC_KEYS",
    "REGEX_GROUPS",
    "REGEX_TIMING",
    "LogReader",
    "ParsedLog",
    "RunShape",
    "TeeLines",
    "UnknownFormat",
    "clean",
    "detect_format",
    "format_named",
    "line_parser",
    "parse_lines",
    "parse_log",
]
