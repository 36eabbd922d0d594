"""Colours and number formats shared by every widget.

Categories use the Okabe–Ito palette, which stays distinguishable for the
common kinds of colour blindness; the same category always has the same colour.
"""
from __future__ import annotations

from tracekit.units import fmt_bytes  # noqa: F401  (re-exported for the widgets)

# The colours live in tracekit (the notebook picture uses them too); re-exported for the widgets.
from tracekit.render.palette import (  # noqa: F401
    BLACK, BLUE, CATEGORY_COLORS, EXTRA_COLORS, FINDING_COLORS, GREEN, GREY, HIGHLIGHT_COLOR, ORANGE, PHASE_COLORS,
    LOW_COLOR, PURPLE, RESERVED_COLOR, RESERVED_FILL, SKY, VERMILLION, YELLOW, category_color, phase_color)


def byte_unit(peak: int) -> tuple[str, float]:
    """The axis unit for a curve that peaks at `peak` bytes: ("GiB", 2**30), ("MiB", 2**20)..."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if peak >= 2 * scale:
            return unit, float(scale)
    return "bytes", 1.0


def fmt_duration_us(us) -> str:
    if us is None:
        return "n/a"
    us = float(us)
    if abs(us) >= 1e6:
        return f"{us / 1e6:.3f} s"
    if abs(us) >= 1e3:
        return f"{us / 1e3:.2f} ms"
    return f"{us:.0f} µs"
