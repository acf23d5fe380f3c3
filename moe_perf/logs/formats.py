"""Every log format moe_perf reads, by trainer.log_format's value: one of `FORMATS`, or a
regular expression with named groups (regex.py). `detect_format` tells which one a log is."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from moe_perf.logs.base import LogFormat
from moe_perf.logs.contract import ContractFormat
from moe_perf.logs.lines import clean
from moe_perf.logs.megatron import MegatronFormat, NemoFormat
from moe_perf.logs.regex import RegexFormat
from moe_perf.logs.torchtitan import TorchtitanFormat

_NAMED: dict[str, type[LogFormat]] = {
    f.name: f for f in (ContractFormat, TorchtitanFormat, MegatronFormat, NemoFormat)
}
FORMATS = tuple(_NAMED)  # contract first: it wins a tie in `detect_format`
# how each format's step line begins, for a message that says what was looked for
FORMAT_LINES = {name: kind.first_words for name, kind in _NAMED.items()}


def format_named(log_format: str) -> LogFormat:
    """A fresh reader's format: by name, else the string as a regex. Raises ValueError for a
    format that is neither a known name nor a usable regex."""
    if log_format in _NAMED:
        return _NAMED[log_format]()
    return RegexFormat(log_format)


def line_parser(log_format: str) -> Callable[[str], dict | None]:
    """The function reading one cleaned line of this format into a raw step dict, or None.
    Raises ValueError for a format that is neither a known name nor a usable regex."""
    return format_named(log_format).parse


class UnknownFormat(ValueError):
    """No line of any format moe_perf knows: the message lists what was looked for."""

    def __init__(self, source: str) -> None:
        tried = ", ".join(f"{name} `{FORMAT_LINES[name]}`" for name in FORMATS)
        super().__init__(f"{source}: no step line of a format moe_perf knows (tried: {tried})")


def detect_format(lines: Iterable[str]) -> str | None:
    """The format whose step lines are most numerous in these lines (contract wins ties)."""
    counts = dict.fromkeys(FORMATS, 0)
    parsers = {name: line_parser(name) for name in FORMATS}
    for line in lines:
        _, text = clean(line)
        for name, parse in parsers.items():
            if parse(text) is not None:
                counts[name] += 1
    best = max(FORMATS, key=lambda name: counts[name])  # first of the maxima: contract first
    return best if counts[best] else None
