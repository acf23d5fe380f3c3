"""What a matplotlib figure draws, read back from its artists: titles, axis labels, the
labelled lines with their data, bar heights, tick labels and texts; and a PNG's pixel size."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class DrawnAxes:
    title: str
    xlabel: str
    ylabel: str
    lines: dict[str, tuple[list[float], list[float]]]  # label -> (x data, y data)
    points: list[tuple[list[float], list[float]]]  # the unlabelled lines' data (markers)
    bars: list[float]  # heights, in drawing order
    xticklabels: list[str]
    texts: list[str]
    legend: list[str]


def drawn(ax) -> DrawnAxes:
    """What one axes shows (the left title where one is set, else the centre one)."""
    data = [(line.get_label(), _floats(line.get_xdata()), _floats(line.get_ydata()))
            for line in ax.get_lines()]  # fmt: skip
    legend = ax.get_legend()
    return DrawnAxes(
        title=ax.get_title(loc="left") or ax.get_title(),
        xlabel=ax.get_xlabel(),
        ylabel=ax.get_ylabel(),
        lines={label: (xs, ys) for label, xs, ys in data if not label.startswith("_")},
        points=[(xs, ys) for label, xs, ys in data if label.startswith("_")],
        bars=_floats(bar.get_height() for container in ax.containers for bar in container),
        xticklabels=[t.get_text() for t in ax.get_xticklabels()],
        texts=[t.get_text() for t in ax.texts],
        legend=[t.get_text() for t in legend.get_texts()] if legend else [],
    )


def _floats(values) -> list[float]:
    return [float(v) for v in values]


def png_pixels(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG file, from its header; fails if the file is not a PNG."""
    head = Path(path).read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert head[12:16] == b"IHDR", f"{path} has no PNG header chunk"
    return struct.unpack(">II", head[16:24])
