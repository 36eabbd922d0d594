"""The estimate panel (gui/estimate_panel.py), offscreen: bars follow the knobs, measured beside predicted."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
pytest.importorskip("PySide6")
pytest.importorskip("pyqtgraph")
pytest.importorskip("pytestqt")

from pathlib import Path  # noqa: E402

from tracekit.analysis.estimate import Setup, estimate, load_shape  # noqa: E402

pytestmark = pytest.mark.gui
SAMPLE = Path(__file__).parents[1] / "samples" / "gpt_adamw.pickle"


def test_bars_follow_the_knobs(qtbot):
    from tracekit_gui.estimate_panel import EstimatePanel

    panel = EstimatePanel()
    qtbot.addWidget(panel)
    panel.model.setCurrentText("llama-3-8b")
    panel.precision.setCurrentText("mixed")
    panel.optimizer.setCurrentText("adam")
    panel.attention.setCurrentText("eager")
    panel.batch.setValue(2)
    panel.seq.setValue(1024)
    expected = estimate(load_shape("llama-3-8b"), Setup(precision="mixed", optimizer="adam", batch=2, seq=1024,
                                                        attention="eager"))
    assert panel.result.per_gpu == expected.per_gpu
    drawn = panel.bars["predicted"]
    assert all(drawn[c] == expected.per_gpu[c] for c in drawn)
    before = panel.result.per_gpu["activation"]
    panel.batch.setValue(4)  # the bar grows as the spin box moves
    assert panel.result.per_gpu["activation"] > before
    panel.quant.setCurrentText("4bit")  # an impossible setup says why and keeps the last bars
    assert "LoRA" in panel.text.text() and panel.result.per_gpu["activation"] > before


@pytest.mark.skipif(not SAMPLE.exists(), reason="sample missing")
def test_measured_beside_predicted(qtbot):
    from tracekit_gui.app import MainWindow
    from tracekit.analysis.estimate.measured import measured_max
    from tracekit.io import load

    window = MainWindow(remember=False)
    qtbot.addWidget(window)
    window.show_estimate()  # no file open: presets only
    assert "measured" not in window.estimate_panel.bars
    trace = load(str(SAMPLE), use_cache=False)
    from tracekit_gui.estimate_panel import RECORDED, EstimatePanel

    panel = EstimatePanel(trace)
    qtbot.addWidget(panel)
    assert panel.model.currentText() == RECORDED
    measured = measured_max(trace, trace.devices[0])
    assert {c: v for c, v in panel.bars["measured"].items()} == {c: measured.get(c, 0) for c in panel.bars["measured"]}
    model = trace.recorder["model"]
    assert panel.bars["predicted"]["parameter"] == model["parameter_bytes"]
