"""The open dialog's quick first pass (tracekit.analysis.survey) and window picker (gui/window_picker.py), offscreen."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from PySide6.QtCore import QTimer  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

import tracekit  # noqa: E402
from tracekit.io.cache import folder as cachefiles  # noqa: E402
from tracekit.analysis.window import Window, select  # noqa: E402
from tracekit.io.unpickle import restricted_load  # noqa: E402
from tracekit.analysis.survey import BYTES_PER_ENTRY, survey  # noqa: E402
from tracekit_gui import window_picker  # noqa: E402
from tracekit_gui.app import MainWindow, wait_loaded  # noqa: E402
from tracekit_gui.window_picker import WindowPicker  # noqa: E402

pytestmark = pytest.mark.gui
ROOT = Path(__file__).parents[1]
LEAK = ROOT / "samples" / "leak_loop.pickle"
LEGACY = ROOT / "tests" / "fixtures" / "real" / "snapshot_legacy_torch20_oom_observer.pickle"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TRACEKIT_SETTINGS", str(tmp_path / "settings.ini"))
    monkeypatch.setattr(cachefiles, "RACY_S", 0.0)  # files copied a moment ago may be fingerprinted
    return tmp_path / "cache"


def _truth(path):
    """Entries, time span and iteration numbers per device, straight from the pickled snapshot."""
    with open(path, "rb") as f:
        snap = restricted_load(f)
    out = []
    for entries in snap["device_traces"]:
        times = [e["time_us"] for e in entries if "time_us" in e]
        its = {int(m.group(1)) for e in entries if (m := re.search(r"iter=(\d+)", e.get("user_metadata", "")))}
        out.append((len(entries), min(times), max(times), (min(its), max(its))))
    return out


def test_a_file_opened_before_is_surveyed_exactly_from_the_cache(tmp_path, cache_dir):
    p = tmp_path / "leak.pickle"
    shutil.copy(LEAK, p)
    cold = survey(p)
    assert not cold.exact and cold.estimated_entries == p.stat().st_size // BYTES_PER_ENTRY
    tracekit.load(p)
    warm = survey(p)
    assert warm.exact
    got = [(d.entries, d.first_us, d.last_us, d.iterations) for d in warm.devices]
    assert got == [t for t in _truth(p) if t[0]]
    assert "iterations" in "\n".join(warm.lines()) and f"{got[0][0]:,} entries" in "\n".join(warm.lines())


def test_the_picker_offers_only_what_the_file_has(qtbot, tmp_path, cache_dir):
    p = tmp_path / "legacy.pickle"
    shutil.copy(LEGACY, p)  # torch 2.0: no time stamps, no iterations
    tracekit.load(p)
    d = WindowPicker(survey(p))
    qtbot.addWidget(d)
    assert not d.recent.isEnabled() and not d.iters.isEnabled() and d.entries.isChecked()
    assert "no time stamps" in d.recent.toolTip() and "no iterations" in d.iters.toolTip()


def test_the_picker_checks_its_ranges(qtbot, tmp_path, cache_dir):
    p = tmp_path / "leak.pickle"
    shutil.copy(LEAK, p)
    tracekit.load(p)
    (n, first_us, last_us, its), = _truth(p)
    d = WindowPicker(survey(p))
    qtbot.addWidget(d)
    assert d.recent.isChecked() and d.seconds.value() == pytest.approx(min(10, (last_us - first_us) / 1e6), abs=1e-3)
    assert d.last.maximum() == n - 1 and (d.it_first.minimum(), d.it_last.maximum()) == its
    d.entries.setChecked(True)
    d.first.setValue(500)
    d.last.setValue(300)
    assert not d.open_button.isEnabled() and "before the first" in d.problem.text()
    d.last.setValue(700)
    assert d.open_button.isEnabled() and d.window() == Window(first=500, last=700)
    d.iters.setChecked(True)
    d.it_first.setValue(its[1])
    d.it_last.setValue(its[0])
    assert not d.open_button.isEnabled()
    d.whole.setChecked(True)
    assert d.open_button.isEnabled() and d.window() is None


def test_the_picker_on_a_file_not_opened_before(qtbot, tmp_path, cache_dir):
    p = tmp_path / "leak.pickle"
    shutil.copy(LEAK, p)
    d = WindowPicker(survey(p))
    qtbot.addWidget(d)
    assert d.whole.isChecked() and d.recent.isEnabled() and d.iters.isEnabled()  # nothing known yet: all offered
    d.recent.setChecked(True)
    d.seconds.setValue(0.25)
    assert d.window() == Window(last_us=250_000)


def test_open_dialog_picks_iterations_of_a_big_file(qtbot, tmp_path, cache_dir, monkeypatch):
    p = tmp_path / "leak.pickle"
    shutil.copy(LEAK, p)
    tracekit.load(p)
    monkeypatch.setattr(window_picker, "BIG_BYTES", 0)  # this small file counts as big
    window = MainWindow(remember=False)
    qtbot.addWidget(window)
    seen = {}

    def answer():
        d = QApplication.activeModalWidget()
        seen["facts"] = d.findChild(type(d.problem), "facts").text()
        d.iters.setChecked(True)
        d.it_first.setValue(1)
        d.it_last.setValue(2)
        d.open_button.click()

    QTimer.singleShot(0, answer)
    assert window.open_picking_window(str(p)) is not None
    assert wait_loaded(window)
    doc = window.current_view().doc
    assert doc.trace.meta["window"]["description"] == "iterations 1..2"
    cli = select(tracekit.load(p, use_cache=False), Window(iterations=(1, 2)))  # what `report --iterations 1..2` reads
    assert 0 < len(doc.trace.events) == len(cli.events) < len(tracekit.load(p).events)
    assert (doc.trace.events.index == cli.events.index).all() and (doc.trace.events.size == cli.events.size).all()
    assert "window: iterations 1..2" in window.current_view().summary.text()
    assert window.current_view().summary.toolTip().startswith("window: iterations 1..2")  # and how it was read
    assert "entries" in seen["facts"]


def test_a_small_file_opens_without_asking(qtbot, tmp_path, cache_dir):
    window = MainWindow(remember=False)
    qtbot.addWidget(window)
    shown = []

    def close_a_modal():
        modal = QApplication.activeModalWidget()
        if modal is not None:
            shown.append(modal)
            modal.reject()

    QTimer.singleShot(0, close_a_modal)
    assert window.open_picking_window(str(LEAK)) is not None
    assert wait_loaded(window)
    assert not shown
    assert "window" not in window.current_view().doc.trace.meta


def test_cancelling_the_picker_opens_nothing(qtbot, tmp_path, cache_dir, monkeypatch):
    monkeypatch.setattr(window_picker, "BIG_BYTES", 0)
    window = MainWindow(remember=False)
    qtbot.addWidget(window)
    QTimer.singleShot(0, lambda: QApplication.activeModalWidget().reject())
    tabs = window.tabs.count()
    assert window.open_picking_window(str(LEAK)) is None
    assert window.tabs.count() == tabs and not window.threads
