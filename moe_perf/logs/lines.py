"""Lines as the launch gave them, made readable: colour codes and launcher prefixes taken off
(`clean`), a line torchrun --tee passed on in two pieces made whole again (`TeeLines`), and
the numbers and timestamps every format prints read the same way."""

from __future__ import annotations

import re
from datetime import datetime

# Colour codes, with their ESC byte or without it (a copy-pasted log): `[31m`, `[38;2;54;234;195m`.
# Without ESC at least one digit is required, so `[moe_perf]` is not mistaken for one.
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m|\[\d[0-9;]*m")
# `srun --label` puts `N: ` first; torchrun --tee puts `[rankN]:` or `[defaultN]:`.
_PREFIX_RE = re.compile(r"^\s*(?:\d+:\s)?\s*(?:\[(?:rank|default)(\d+)\]:)?")
# torchrun's own prefix anywhere in a line; `srun --label` comes only first.
_TEE_PREFIX_RE = re.compile(r"\[(?:rank|default)\d+\]:")
SRUN_LABEL_RE = re.compile(r"^\s*\d+:\s")
# a printed number: thousands commas, exponents, nan/inf, or `N/A` (not computed)
NUM = r"([-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf)|N/A)"
_TIMESTAMP_RE = re.compile(r"(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:[,.](\d{1,6}))?")
GIB_PER_UNIT = {
    "gib": 1.0,
    "gb": 1e9 / 2**30,
    "mib": 1 / 1024,
    "mb": 1e6 / 2**30,
    "kib": 1 / 2**20,
    "kb": 1e3 / 2**30,
    "b": 1 / 2**30,
}


def clean(line: str) -> tuple[int | None, str]:
    """(torchrun local rank or None, the line without colour codes and launcher prefixes)."""
    text = _ANSI_RE.sub("", line.rstrip("\r\n"))
    match = _PREFIX_RE.match(text)
    rank = int(match.group(1)) if match.group(1) is not None else None
    return rank, text[match.end() :]


def srun_label(line: str) -> str:
    """srun --label's task number (`0`, `1`: the node), or "" where the line has none."""
    label = SRUN_LABEL_RE.match(line)
    return label.group(0).strip() if label else ""


class TeeLines:
    """Whole lines back from torchrun --tee's stdout. torchrun copies each rank's log file with
    readline(), which at the end of a file returns what is written so far; so a line can come
    in two pieces, each with the rank's prefix and no newline after the first, other ranks'
    lines glued on in between: `[rank1]:...step:  6 ...tps: 3,1[rank0]:...step:  6 ...` then
    `[rank1]:90  tflops: ...`. Read as lines, both would be rank 1's step 6 with other values
    (seen once in CI), or a cut number a wrong figure. `split` gives each whole line once, with
    its prefix; `rest` the pieces a stream ended on. A prefix right after another is a rank's
    text (torch's C++ warnings start `[rank0]:`), never a cut: readline never returns ""."""

    def __init__(self) -> None:
        self._pending: dict[str, str] = {}  # srun label + prefix -> the line so far

    def split(self, line: str) -> list[str]:
        line = line.rstrip("\n")
        label = SRUN_LABEL_RE.match(line)
        label = label.group(0) if label else ""
        whole = []
        pieces = _pieces(line, label)
        for i, (key, text) in enumerate(pieces):
            if key is None:  # before any prefix: torchrun's own words, or not torchrun's
                whole.append(label + text)
                continue
            text = self._pending.pop(key, "") + text
            if i < len(pieces) - 1:
                self._pending[key] = text  # no newline after it: the line goes on later
            else:
                whole.append(key + text)
        return whole

    def rest(self) -> list[str]:
        """The pieces no newline ever ended (a rank killed mid-line)."""
        rest = [key + text for key, text in self._pending.items()]
        self._pending.clear()
        return rest


def _pieces(line: str, label: str) -> list[tuple[str | None, str]]:
    """(srun label + torchrun prefix, or None before any prefix; the text) in arrival order."""
    pieces, key, start = [], None, len(label)
    for cut in _TEE_PREFIX_RE.finditer(line, len(label)):
        if cut.start() == start and key is not None:
            continue  # right after a prefix: the rank's own text
        if cut.start() > start or key is not None:
            pieces.append((key, line[start : cut.start()]))
        key, start = label + cut.group(0), cut.end()
    pieces.append((key, line[start:]))
    return pieces


def number(text: str | None) -> float | None:
    """A printed number (`72,915`, `1e-3`, `nan`), or None for `N/A` and what is no number."""
    if text is None or text == "N/A":
        return None
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def search(pattern: re.Pattern, text: str) -> float | None:
    """The number of the pattern's first group in this text, or None."""
    match = pattern.search(text)
    return number(match.group(1)) if match else None


def timestamp(text: str) -> float | None:
    """Seconds of the line's `YYYY-MM-DD HH:MM:SS[,mmm]` timestamp (for differences only)."""
    match = _TIMESTAMP_RE.search(text)
    if not match:
        return None
    day, clock, fraction = match.groups()
    try:
        when = datetime.strptime(f"{day} {clock}", "%Y-%m-%d %H:%M:%S")
    except ValueError:
        return None
    return when.timestamp() + (float(f"0.{fraction}") if fraction else 0.0)
