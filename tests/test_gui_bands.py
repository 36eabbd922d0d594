"""The phase lane's bands (gui/timeline.PhaseBands): what a frame paints, against a naive lookup."""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
pytest.importorskip("PySide6")
pytest.importorskip("pyqtgraph")

from tracekit_gui.timeline import PhaseBands  # noqa: E402

pytestmark = pytest.mark.gui
COLORS = ["#ff0000", "#00ff00", "#0000ff"]


def spans(n, seed=0):
    """n back-to-back spans with gaps here and there, each a colour of three."""
    rng = np.random.default_rng(seed)
    widths = rng.exponential(1.0, n)
    gaps = np.where(rng.random(n) < 0.1, rng.exponential(0.5, n), 0.0)
    x0 = np.cumsum(widths + gaps) - widths
    return x0, x0 + widths, [COLORS[i] for i in rng.integers(0, 3, n)]


def naive_colour(x0, x1, colours, x):
    inside = [c for a, b, c in zip(x0, x1, colours) if a <= x < b]
    return inside[-1] if inside else None


@pytest.mark.parametrize("view", [(0.0, 1.0), (0.3, 0.31), (0.5, 0.9)])
def test_more_spans_than_pixels_paint_the_span_under_each_column(view):
    x0, x1, colours = spans(5000)
    bands = PhaseBands(x0, x1, colours)
    lo, hi = x1.max() * view[0], x1.max() * view[1]
    pixels = 300
    a, b, k = bands.runs(lo, hi, pixels)
    assert len(a) <= pixels and (b > a).all() and (a[1:] >= b[:-1] - 1e-9).all()
    names = list(dict.fromkeys(colours))
    step = (hi - lo) / pixels
    for p in range(pixels):
        centre = lo + (p + 0.5) * step
        want = naive_colour(x0, x1, colours, centre)
        got = [names[c] for s, e, c in zip(a, b, k) if s <= centre < e]
        assert got == ([want] if want else []), (p, centre)


def test_few_spans_in_view_are_painted_exactly():
    x0, x1, colours = spans(5000, seed=1)
    bands = PhaseBands(x0, x1, colours)
    lo, hi = float(x0[1000]) + 0.25, float(x1[1040])
    a, b, k = bands.runs(lo, hi, 1200)
    rows = [i for i in range(5000) if x1[i] > lo and x0[i] <= hi]
    assert a.tolist() == x0[rows].tolist() and b.tolist() == x1[rows].tolist()
    names = list(dict.fromkeys(colours))
    assert [names[c] for c in k.tolist()] == [colours[i] for i in rows]


def test_no_spans_in_view():
    x0, x1, colours = spans(100, seed=2)
    a, b, k = PhaseBands(x0, x1, colours).runs(float(x1.max()) + 1, float(x1.max()) + 2, 500)
    assert len(a) == len(b) == len(k) == 0
