"""Colours of categories, phases and findings, shared by the viewer and the notebook picture.

Categories use the Okabe–Ito palette, which stays distinguishable for the
common kinds of colour blindness; the same category always has the same colour.
"""
from __future__ import annotations

# Okabe & Ito (2008), "Color Universal Design".
BLACK, ORANGE, SKY, GREEN, YELLOW, BLUE, VERMILLION, PURPLE = (
    "#000000", "#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7")
GREY = "#9A9A9A"

CATEGORY_COLORS = {
    "parameter": BLUE,
    "gradient": ORANGE,
    "optimizer_state": PURPLE,
    "activation": GREEN,
    "temporary": VERMILLION,
    "input": SKY,
    "kv_cache": YELLOW,
    "workspace": "#C9B79C",  # a handle's scratch space: a quiet sand, like overhead
    "unsharded_parameter": "#7FB8E0",  # a unit's full parameters, all-gathered: a lighter parameter blue
    "communication": "#8C6D5A",  # collective buffers (all-gather / reduce-scatter staging, DDP buckets)
    "other": GREY,
    "allocated": BLUE,  # shown when a file has no categories
}
# User-defined categories (kv_cache, ...) take these in order of appearance.
EXTRA_COLORS = (YELLOW, "#7F3C8D", "#11A579", "#3969AC", "#F2B701", "#80BA5A", "#E68310")

# Phases are greys, so they never read as a category.
PHASE_COLORS = {"forward": "#DADADA", "backward": "#B4B4B4", "optimizer": "#8A8A8A",
                 "prefill": "#9C9C9C", "decode": "#D6D6D6", "decode (odd)": "#C2C2C2"}


def phase_color(name: str) -> str:
    """A phase band's colour: a generation's decoding steps ("step 7") alternate two light greys."""
    if name.startswith("step "):
        try:
            return PHASE_COLORS["decode (odd)" if int(name[5:]) % 2 else "decode"]
        except ValueError:
            return PHASE_COLORS["decode"]
    return PHASE_COLORS.get(name, "#BBBBBB")
RESERVED_FILL = "#EFEFEF"  # reserved but not allocated (the caching allocator's spare)
FINDING_COLORS = {"peak": BLACK, "spike": VERMILLION, "leak": PURPLE, "oom": "#C00000",
                  "fragmentation": "#666666", "advice": BLUE}
RESERVED_COLOR = "#444444"
LOW_COLOR = "#9A9A9A"  # the curve's lowest entry per bucket, where a plot has fewer points than entries
HIGHLIGHT_COLOR = "#000000"


def category_color(name: str, names=()) -> str:
    """The colour of a category; unknown ones get a stable extra colour by position in `names`."""
    if name in CATEGORY_COLORS:
        return CATEGORY_COLORS[name]
    extra = [n for n in names if n not in CATEGORY_COLORS]
    i = extra.index(name) if name in extra else abs(hash(name))
    return EXTRA_COLORS[i % len(EXTRA_COLORS)]
