"""The viewer's compare view and rank dashboard (offscreen)."""
from __future__ import annotations

import shutil

import pytest

pytest.importorskip("PySide6")
pytest.importorskip("pyqtgraph")
pytest.importorskip("pytestqt")

from PySide6.QtCore import Qt  # noqa: E402

import tracekit  # noqa: E402
from tracekit.analysis.diff import diff  # noqa: E402
from tracekit_gui.app import MainWindow  # noqa: E402
from tracekit_gui.compare import CompareView  # noqa: E402
from tracekit_gui.ranks import RankDashboard  # noqa: E402

from .conftest import SAMPLES  # noqa: E402
from .oracle import naive_replay  # noqa: E402


@pytest.fixture
def window(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("TRACEKIT_SETTINGS", str(tmp_path / "settings.ini"))
    w = MainWindow()
    qtbot.addWidget(w)
    w.resize(1400, 900)
    w.show()
    return w


def test_compare_view_lists_the_allocations_behind_each_site(qtbot):
    a, b = tracekit.load(SAMPLES / "gpt_adamw.pickle"), tracekit.load(SAMPLES / "logits_spike.pickle")
    view = CompareView(a, b)
    qtbot.addWidget(view)
    sections = [view.tree.topLevelItem(i).text(0) for i in range(view.tree.topLevelItemCount())]
    assert sections[:3] == ["at the peak, by category", "aligned by phase", "at the peak, by site"]
    # the two timelines share one scale, and it holds the larger peak
    (_, top_a), (_, top_b) = (p.viewRange()[1] for p in view.plots)
    assert top_a == top_b >= view.pair["peak_allocated_bytes"]["b"] / 2**20
    for row in view.pair["sites_at_peak"]:  # the lists on both sides add up to the site's change
        assert view.show_allocations("site", row["site"]) == [row["a"], row["b"]]
    for name, c in view.pair["categories_at_peak"].items():
        assert view.show_allocations("category", name) == [c["a"], c["b"]]
    assert view.delta.listDataItems()  # the difference over the aligned step is drawn
    site = view.tree.topLevelItem(2).child(0)
    view.tree.setCurrentItem(site)
    assert view.side_labels[1].text().startswith("B: ") and view.sides[1].rowCount() > 0


def test_window_compares_two_files_and_opens_a_rank_folder(window, qtbot, tmp_path):
    window.open_compare(SAMPLES / "gpt_adamw.pickle", SAMPLES / "leak_loop.pickle")
    qtbot.waitUntil(lambda: not window.threads, timeout=120_000)
    view = window.tabs.currentWidget()
    assert isinstance(view, CompareView) and window.last_error is None
    assert view.pair["peak_allocated_bytes"] == diff(tracekit.load(SAMPLES / "gpt_adamw.pickle"),
                                                     tracekit.load(SAMPLES / "leak_loop.pickle"))["devices"][0][
        "peak_allocated_bytes"]
    job = tmp_path / "job"
    job.mkdir()
    for rank, name in enumerate(("gpt_adamw", "gpt_adamw", "logits_spike")):
        shutil.copy(SAMPLES / f"{name}.pickle", job / f"run.rank{rank}.pickle")
    window.open_ranks(job)
    qtbot.waitUntil(lambda: not window.threads, timeout=120_000)
    dash = window.tabs.currentWidget()
    assert isinstance(dash, RankDashboard) and len(dash.plots) == 3
    assert "(outlier)" in dash.plots[2].plotItem.titleLabel.text
    assert "(outlier)" not in dash.plots[0].plotItem.titleLabel.text
    with open(SAMPLES / "logits_spike.pickle", "rb") as f:
        from tracekit.io.unpickle import restricted_load

        assert dash.table["ranks"][2]["peak_allocated_bytes"] == naive_replay(restricted_load(f))["peak"]
    opened = []
    dash.open_file.connect(opened.append)
    qtbot.mouseClick(dash.plots[1].viewport(), Qt.LeftButton)
    assert opened == [str(job / "run.rank1.pickle")]
