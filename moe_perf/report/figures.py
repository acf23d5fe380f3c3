"""The report's one matplotlib setup, for every picture it draws (render.py, render_explain.py,
imbalance.py): files only, never a display."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend: no display on clusters. Imported here, when a
    picture is drawn, so a comparison without one never loads matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # set before pyplot is imported
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> Path:
    """Writes the figure to `path` (PNG, 100 dpi) and frees it."""
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    return path
