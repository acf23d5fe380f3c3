"""Each arm's colour, the same in every picture the report draws."""

from __future__ import annotations

ARM_COLOURS = {"base": "tab:blue", "feat": "tab:orange"}  # neutral: no good/bad colours


def arm_colour(arm: str) -> str:
    return ARM_COLOURS.get(arm, "tab:gray")
