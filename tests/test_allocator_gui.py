"""The allocator window (gui/fragmentation.py), offscreen: the numbers it shows are the replay's, the segments
drawn are the model's at the peak, a click moves them, a what-if draws its curves and says bad settings."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
pytest.importorskip("PySide6")
pytest.importorskip("pyqtgraph")
pytest.importorskip("pytestqt")

pytestmark = pytest.mark.gui
FILE = Path(__file__).parents[1] / "tests" / "fixtures" / "cuda" / "opt_amp_adamw_b4_s256.pickle.gz"


def test_allocator_window(qtbot):
    from tracekit_gui.app import MainWindow, wait_loaded
    from tracekit.analysis.allocator.view import fragmentation
    from tracekit.units import fmt_bytes

    window = MainWindow(remember=False)
    qtbot.addWidget(window)
    assert window.show_allocator() is None  # nothing open yet
    window.open_file(FILE, use_cache=False)
    assert wait_loaded(window)
    panel = window.show_allocator()
    qtbot.addWidget(panel)
    v = fragmentation(window.current_view().doc.trace, 0)
    assert v.exact and v.index == v.peak_index and v.allocated_at == 1142205440
    text = panel.caption.text()
    for figure in (v.reserved_at, v.allocated_at, v.unused_at, v.largest_free):
        assert fmt_bytes(figure) in text
    assert "exact" in text and v.largest_free > 0
    drawn = [i for i in panel.segments.getPlotItem().items]
    largest = sorted(v.segments, key=lambda s: -s["total_size"])[:80]
    assert drawn and len(drawn[0].opts["x0"]) == sum(len(s["blocks"]) for s in largest)
    panel.show_index(10)  # another moment (a click on the curves does this)
    assert panel.view.index == 10 and "entry 10" in panel.caption.text()
    panel.conf.setText("expandable_segments:True")
    panel.run_whatif()
    assert "What if expandable_segments:True" in panel.whatif_label.text()
    assert len(panel.what_reserved.getData()[1]) == len(v.allocated)
    panel.conf.setText("nonsense:1")
    panel.run_whatif()
    assert "unknown setting" in panel.whatif_label.text()
