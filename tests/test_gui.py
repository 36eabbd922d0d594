"""The desktop viewer, offscreen: opening files, errors, selection, findings, export, CLI."""
from __future__ import annotations

import csv
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
pytest.importorskip("PySide6")
pytest.importorskip("pyqtgraph")
pytest.importorskip("pytestqt")

from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl  # noqa: E402
from PySide6.QtGui import QDropEvent  # noqa: E402

from tracekit_gui import display  # noqa: E402
from tracekit_gui.app import MainWindow  # noqa: E402
from tracekit_gui.docview import DocumentView  # noqa: E402
from tracekit_gui.tables import SIZE, WHERE  # noqa: E402

pytestmark = pytest.mark.gui

ROOT = Path(__file__).parents[1]
REAL = ROOT / "tests" / "fixtures" / "real"
NEWEST = REAL / "snapshot_newest_format_windows_paths.pickle"
KINETO = REAL / "kineto_trace_memory_v100_rank1.json.gz"
REAL_FILES = sorted(p for p in REAL.glob("*") if p.suffix != ".md" and p.name != "truth.json")  # truth.json: answers
SAMPLES = sorted(p for p in (ROOT / "samples").glob("*") if p.is_file() and p.suffix in (".pickle", ".gz", ".json"))


def needs(path):
    return pytest.mark.skipif(not path.exists(), reason=f"{path.name} not present")


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    old = os.environ.get("TRACEKIT_CACHE_DIR")
    os.environ["TRACEKIT_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if old is None:
        os.environ.pop("TRACEKIT_CACHE_DIR", None)
    else:
        os.environ["TRACEKIT_CACHE_DIR"] = old


@pytest.fixture
def settings_file(tmp_path, monkeypatch):
    path = tmp_path / "settings.ini"
    monkeypatch.setenv("TRACEKIT_SETTINGS", str(path))
    return path


@pytest.fixture
def window(qtbot, settings_file):
    w = MainWindow()
    qtbot.addWidget(w)
    w.resize(1400, 900)
    w.show()
    return w


def open_and_wait(window, qtbot, path, **kw) -> DocumentView | None:
    window.open_file(path, **kw)
    qtbot.waitUntil(lambda: not window.threads, timeout=60_000)
    return window.current_view()


@pytest.fixture
def newest(window, qtbot):
    if not NEWEST.exists():
        pytest.skip("real fixtures not present")
    return open_and_wait(window, qtbot, NEWEST)


# ---- opening -------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", REAL_FILES + SAMPLES, ids=lambda p: p.name)
def test_opens_file(window, qtbot, path):
    view = open_and_wait(window, qtbot, path)
    assert window.last_error is None
    assert isinstance(view, DocumentView)
    rep = view.doc.replays[view.device]
    assert view.timeline.last_query is not None  # the curve was drawn
    assert view.model.rowCount() == len(rep.allocations)
    assert path.name in window.statusBar().currentMessage()
    assert path.name in window.windowTitle()


@needs(KINETO)
def test_device_selector(window, qtbot):
    view = open_and_wait(window, qtbot, KINETO)
    assert view.device_box.isVisibleTo(window) and view.device_box.count() == 2
    other = [d for d in view.doc.devices if d != view.device][0]
    view.device_box.setCurrentIndex(view.doc.devices.index(other))
    assert view.device == other and view.timeline.device == other
    assert view.model.rowCount() == len(view.doc.replays[other].allocations)


def test_report_and_viewer_give_one_time_for_the_peak(window, qtbot):
    """Same entry, same seconds: the report's "+t s" and the viewer's axis share one time base
    (the file's first timed entry on any device), checked on a two-device profiler trace."""
    import re

    from tracekit.model import NO_TIME

    report = subprocess.run([sys.executable, "-m", "tracekit.cli", "report", str(KINETO)], capture_output=True,
                            text=True, timeout=120).stdout
    report_times = [float(t) for t in re.findall(r"peak allocated .* at entry \d+ \(\+([\d.]+) s\)", report)]
    view = open_and_wait(window, qtbot, KINETO)
    doc = view.doc
    t = doc.trace.events.time_us
    t0 = t[t != NO_TIME].min()  # independent: the earliest time in the file
    viewer_times, expected = [], []
    for d in doc.devices:
        rep = doc.replays[d]
        viewer_times.append(round(doc.x_of(d, rep.peak_index), 3))
        expected.append(round((int(t[rep.events][rep.peak_index]) - t0) / 1e6, 3))
    assert len(report_times) == 2 and report_times == viewer_times == expected


def test_several_files_in_tabs_and_close(window, qtbot, newest):
    open_and_wait(window, qtbot, NEWEST)
    assert len(window.document_views()) == 2
    window.close_tab(window.tabs.currentIndex())
    assert len(window.document_views()) == 1
    window.close_tab(window.tabs.currentIndex())
    assert window.tabs.count() == 1 and window.current_view() is None  # back to the welcome page


def test_drop_opens_file(window, qtbot):
    if not NEWEST.exists():
        pytest.skip("real fixtures not present")
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(NEWEST))])
    event = QDropEvent(QPointF(10, 10), Qt.CopyAction, mime, Qt.LeftButton, Qt.NoModifier)
    window.dropEvent(event)
    qtbot.waitUntil(lambda: not window.threads, timeout=60_000)
    view = window.current_view()  # the dropped file, opened as any file is: its allocations in the table
    assert view is not None and os.path.samefile(view.doc.path, NEWEST)
    import tracekit
    from tracekit.analysis.replay import replay

    assert view.model.rowCount() == len(replay(tracekit.load(NEWEST, use_cache=False))[view.device].allocations)


def test_cancel_loading(window, qtbot):
    import gc

    if not NEWEST.exists():
        pytest.skip("real fixtures not present")
    loading = window.open_file(NEWEST, use_cache=False)
    assert not gc.isenabled()  # paused while the worker thread runs
    window.threads[loading].cancel()
    qtbot.waitUntil(lambda: not window.threads, timeout=60_000)
    assert window.current_view() is None and window.last_error is None
    assert "cancelled" in window.statusBar().currentMessage()
    assert gc.isenabled()


# ---- errors --------------------------------------------------------------------------------------

def test_empty_file_shows_error(window, qtbot, tmp_path):
    empty = tmp_path / "empty.pickle"
    empty.write_bytes(b"")
    assert open_and_wait(window, qtbot, empty) is None
    assert "empty" in window.last_error and str(empty) in window.last_error
    assert window.error_box.isVisible() and "empty" in window.error_box.text()
    assert not window.document_views()


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused(window, qtbot, tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps({"segments": [_Evil(marker)]}))
    assert open_and_wait(window, qtbot, evil) is None
    assert "refused" in window.last_error and "system" in window.last_error
    assert not marker.exists()


# ---- exploring -----------------------------------------------------------------------------------

def test_select_allocation_shows_stack_and_lifetime(newest):
    view = newest
    view.filter_edit.setText("log_softmax")
    view._apply_filter()
    assert view.model.rowCount() > 0
    assert all("log_softmax" in view.model.index(r, WHERE).data() for r in range(view.model.rowCount()))
    view.table.selectRow(0)
    text = view.inspector.text.toPlainText()
    assert "Allocated at" in text and "log_softmax" in text and "nn_utils.py:" in text
    assert view.timeline._highlight, "the lifetime is shaded on the timeline"
    region = view.timeline._highlight[0].getRegion()
    row = view.model.row_of(0)
    al = view.doc.replays[view.device].allocations
    assert region[0] == pytest.approx(view.doc.x_of(view.device, al.alloc_index[row]))


def test_sort_by_size(newest):
    view = newest
    view.model.sort(SIZE, Qt.AscendingOrder)
    sizes = view.doc.replays[view.device].allocations.size[view.model.order]
    assert (sizes[:-1] <= sizes[1:]).all()


def test_finding_moves_timeline(newest):
    view = newest
    findings = view.doc.findings(view.device)
    peak = next(i for i, f in enumerate(findings) if f["kind"] == "peak")
    full = view.timeline.vb.viewRange()[0]
    view.findings.select_finding(peak)
    (x0, x1), _ = view.timeline.vb.viewRange()
    x_peak = view.doc.x_of(view.device, findings[peak]["index"])
    assert x0 <= x_peak <= x1 and (x1 - x0) < (full[1] - full[0]) / 2
    assert view.cursor_index == findings[peak]["index"]
    assert "PEAK" in view.inspector.title.text()


def test_cursor_breakdown_and_live_filter(newest):
    view = newest
    rep = view.doc.replays[view.device]
    view.pin_cursor(rep.peak_index)
    assert view.breakdown.cell("total allocated", 1) == view.breakdown.cell("total allocated", 2)
    view.live_box.setChecked(True)
    live = rep.allocations.live_at(rep.peak_index)
    assert view.model.rowCount() == int(live.sum())
    assert rep.allocations.size[view.model.order].sum() == rep.peak_allocated


def test_zoom_requeries_visible_range(window, newest):
    view = newest
    view.timeline.refresh()
    start, end, _, _ = view.timeline.last_query
    window._timeline_do("zoom", 0.25)
    view.timeline.refresh()
    s2, e2, _, _ = view.timeline.last_query
    assert (e2 - s2) < (end - start)
    window._timeline_do("reset_zoom")
    view.timeline.refresh()
    assert view.timeline.last_query[:2] == (start, end)


# ---- export and settings ---------------------------------------------------------------------------

def test_export_png_and_csv(window, newest, tmp_path):
    png = window.export_png(str(tmp_path / "timeline.png"))
    from PySide6.QtGui import QImage

    saved, shown = QImage(png), newest.timeline.grab().toImage()
    assert not saved.isNull() and saved.size() == shown.size()  # the timeline as it is on screen, legend included
    assert saved.convertToFormat(QImage.Format_RGB32) == shown.convertToFormat(QImage.Format_RGB32)
    view = newest
    view.filter_edit.setText("nn_utils")
    view._apply_filter()
    out = window.export_csv(str(tmp_path / "alloc.csv"))
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == view.model.rowCount() > 0
    assert all("nn_utils" in r["where"] for r in rows)


def test_settings_remember_recent_and_geometry(window, newest, settings_file):
    assert window.recent_files()[0] == str(NEWEST.resolve()) or window.recent_files()[0] == os.path.abspath(NEWEST)
    window.close()
    text = settings_file.read_text()
    assert "geometry" in text and "recent" in text


def test_a_snapshot_without_a_timeline_is_shown_as_bars_of_what_was_live(window, qtbot):
    legacy = REAL / "snapshot_legacy_torch20_oom_observer.pickle"
    view = open_and_wait(window, qtbot, legacy)
    tl = view.timeline
    assert tl.snapshot_only and tl.bars.isVisibleTo(window) and not tl.graphics.isVisibleTo(window)
    from tracekit.analysis.live import live_by_site

    sites = live_by_site(view.doc.trace, view.device)
    (row,) = tl.bars.rows  # one category: a dump without a trace says nothing of what its blocks are
    assert row["category"] == "other" and row["bytes"] == sum(r["bytes"] for r in sites) == 11840159744
    assert row["count"] == 460 and row["parts"][0][0] == "flexgen/pytorch_backend.py:190 in allocate"
    timeline = open_and_wait(window, qtbot, NEWEST).timeline  # a real trace keeps its time axis
    assert not timeline.snapshot_only and timeline.graphics.isVisibleTo(window)


def test_peak_caption_stays_inside_the_plot(newest, qtbot):
    """Zoomed so the peak sits at the left or right edge, or at the top, its caption is not clipped."""
    tl = newest.timeline
    qtbot.waitExposed(newest)
    label, x, y = tl._marker_labels[0]
    lo, hi = newest.doc.x_range(newest.device)
    span = (hi - lo) * 0.2
    for x0, x1 in ((x, x + span), (x - span, x), (lo, hi)):
        tl.vb.setXRange(x0, x1, padding=0)
        tl.refresh()
        qtbot.wait(10)
        inside = tl.vb.sceneBoundingRect().adjusted(-1, -1, 1, 1)
        assert inside.contains(label.sceneBoundingRect()), (x0, x1)


# ---- command line ----------------------------------------------------------------------------------

@needs(NEWEST)
def test_cli_screenshot(tmp_path):
    out = tmp_path / "shot.png"
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", TRACEKIT_SETTINGS=str(tmp_path / "s.ini"))
    proc = subprocess.run([sys.executable, "-m", "tracekit.cli", "view", str(NEWEST), "--screenshot", str(out)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    from PySide6.QtGui import QImage

    image = QImage(str(out))
    assert image.width() >= 1280 and image.height() >= 800


def test_cli_view_honours_the_cache_settings(tmp_path):
    """TRACEKIT_CACHE_DIR says where the viewer caches; --no-cache leaves it untouched."""
    cache = tmp_path / "cache"
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", TRACEKIT_SETTINGS=str(tmp_path / "s.ini"),
               TRACEKIT_CACHE_DIR=str(cache))
    for extra, cached in ((["--no-cache"], 0), ([], 1)):
        proc = subprocess.run([sys.executable, "-m", "tracekit.cli", "view", str(SAMPLES[0]), *extra, "--screenshot",
                               str(tmp_path / "x.png")], capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert len(list(cache.glob("*.tkc")) if cache.exists() else []) == cached


def test_cli_screenshot_error_is_clear(tmp_path):
    empty = tmp_path / "empty.pickle"
    empty.write_bytes(b"")
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", TRACEKIT_SETTINGS=str(tmp_path / "s.ini"))
    proc = subprocess.run([sys.executable, "-m", "tracekit.cli", "view", str(empty), "--screenshot",
                           str(tmp_path / "x.png")], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "empty" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_without_qt(monkeypatch):
    from click.testing import CliRunner

    from tracekit.commands.view import command

    monkeypatch.setitem(sys.modules, "PySide6", None)
    result = CliRunner().invoke(command, ["x.pickle"])
    assert result.exit_code != 0 and "pip install 'torch-tracekit[gui]'" in result.output


def test_hover_shows_breakdown_under_mouse(newest, qtbot):
    view = newest
    tl = view.timeline
    qtbot.waitExposed(view)
    rect = tl.plot.sceneBoundingRect()
    pos = tl.graphics.mapFromScene(rect.center())
    qtbot.mouseMove(tl.graphics.viewport(), pos)
    qtbot.waitUntil(lambda: view.breakdown.caption.text().startswith("Under the mouse"), timeout=5000)
    assert tl.hover_line.isVisible()
    qtbot.mouseClick(tl.graphics.viewport(), Qt.LeftButton, pos=pos)
    qtbot.waitUntil(lambda: view.cursor_index is not None, timeout=5000)
    assert view.breakdown.caption.text().startswith("Pinned")


def test_keyboard_shortcuts(window):
    from PySide6.QtGui import QAction, QKeySequence

    shortcuts = {k.toString(QKeySequence.PortableText) for a in window.findChildren(QAction) for k in a.shortcuts()}
    for key in ("Ctrl+O", "Ctrl+W", "Ctrl+Q", "Ctrl++", "Ctrl+-", "Ctrl+0"):
        assert key in shortcuts, key


def test_selecting_an_allocation_out_of_view_brings_it_into_view(newest):
    view = newest
    al = view.doc.replays[view.device].allocations
    view.timeline.show_entries(0, 5)
    target = int(al.alloc_index.argmax())  # the last allocation made: far right of the trace
    assert not view.timeline.region_in_view(int(al.alloc_index[target]), int(al.free_index[target]))
    assert view.select_allocation(target) >= 0
    assert view.timeline.region_in_view(int(al.alloc_index[target]), int(al.free_index[target]))


def test_garbage_collection_is_back_on_after_a_load_nobody_polls(qtbot):
    """Loads pause automatic gc; it must come back when the worker ends, even if the GUI side
    never polls it again (its window closed mid-load), or every later allocation leaks cycles."""
    import gc

    from tracekit_gui.loader import LoadThread

    assert gc.isenabled()
    loader = LoadThread(NEWEST)
    loader.start()
    loader._timer.stop()  # as if its window went away
    loader._thread.join(60)
    try:
        assert gc.isenabled()
    finally:
        gc.enable()


# ---- a real display (Xvfb) ---------------------------------------------------------------------------

def _xvfb_problem() -> str | None:
    if not sys.platform.startswith("linux"):
        return "Xvfb is a Linux test"
    if not shutil.which("Xvfb"):
        return "Xvfb is not installed (apt-get install xvfb; .ci/run installs it)"
    return display.problem({"DISPLAY": ":0"})


@pytest.fixture(scope="module")
def xvfb():
    """A private X server (Xvfb picks a free display number); yields its DISPLAY."""
    why = _xvfb_problem()
    if why:
        pytest.skip(f"no real-window test: {why}")
    server = subprocess.Popen(["Xvfb", "-displayfd", "1", "-screen", "0", "1600x1000x24", "-nolisten", "tcp"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        number = server.stdout.readline().strip()
        assert number.isdigit(), "Xvfb did not start"
        yield f":{number}"
    finally:
        server.terminate()
        server.wait(10)


def test_real_window_under_xvfb(xvfb, tmp_path):
    """The viewer opens a window on a real X server (Qt's xcb plugin), draws the sample, and screenshots it."""
    out = tmp_path / "shot.png"
    env = dict(os.environ, DISPLAY=xvfb, QT_QPA_PLATFORM="xcb", TRACEKIT_SETTINGS=str(tmp_path / "s.ini"))
    proc = subprocess.run([sys.executable, "-m", "tracekit.cli", "view", str(SAMPLES[0]), "--screenshot", str(out)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    from PySide6.QtGui import QColor, QImage

    from tracekit_gui.palette import CATEGORY_COLORS

    image = QImage(str(out))
    assert (image.width(), image.height()) == (1440, 900)
    # The plot was drawn: the parameter band's colour covers a visible area of the window.
    want = QColor(CATEGORY_COLORS["parameter"]).rgb()
    hits = sum(image.pixel(x, y) == want for x in range(0, 1440, 4) for y in range(0, 900, 4))
    assert hits > 500


def test_missing_system_libraries_are_named_with_their_packages(monkeypatch):
    monkeypatch.setattr(display, "missing_libraries", lambda plugin: ["libxcb-icccm.so.4", "libxcb-cursor.so.0"])
    monkeypatch.setattr(display, "xcb_plugin", lambda: "/x/libqxcb.so")
    why = display.problem({"DISPLAY": ":1"})
    assert "libxcb-icccm.so.4" in why and "sudo apt-get install libxcb-icccm4 libxcb-cursor0" in why
    assert "\n" not in why
    assert display.problem({"DISPLAY": ":1", "QT_QPA_PLATFORM": "offscreen"}) is None  # no window needed
    assert display.problem({}) is None  # no display: `tracekit view` says so itself


@pytest.mark.skipif(not shutil.which("ldd"), reason="ldd (glibc) is needed to list a plugin's libraries")
def test_a_library_the_plugin_needs_but_the_system_lacks_is_found(tmp_path):
    """A copy of the real xcb plugin that asks for a library no system has: ldd says so, the check names it."""
    data = Path(display.xcb_plugin()).read_bytes()
    assert b"libxcb-icccm.so.4\0" in data
    broken = tmp_path / "libqxcb.so"
    broken.write_bytes(data.replace(b"libxcb-icccm.so.4\0", b"libxcb-icccm.so.9\0"))
    assert "libxcb-icccm.so.9" in display.missing_libraries(str(broken))


def test_check_names_missing_python_packages(monkeypatch):
    assert display.missing_packages() is None
    monkeypatch.setitem(sys.modules, "pyqtgraph", None)  # as if not installed
    assert display.missing_packages() == "the viewer needs pyqtgraph: pip install 'torch-tracekit[gui]'"


@pytest.mark.skipif(not shutil.which("dpkg"), reason="dpkg (Debian/Ubuntu) is needed to check package names")
def test_package_names_match_the_packages_that_ship_the_libraries():
    """debian_package(soname) against dpkg's own answer, for every library the xcb plugin links that is installed."""
    plugin = display.xcb_plugin()
    out = subprocess.run(["ldd", plugin], capture_output=True, text=True).stdout
    checked = 0
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == "=>" and parts[2].startswith("/") and "PySide6" not in parts[2]:
            owner = subprocess.run(["dpkg", "-S", os.path.realpath(parts[2])], capture_output=True, text=True)
            if owner.returncode == 0:
                package = owner.stdout.split(":")[0]
                assert display.debian_package(parts[0]) == package, parts[0]
                checked += 1
    assert checked >= 10


def test_readme_and_ci_install_the_packages_the_check_knows():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    for package in display.XCB_PACKAGES:
        assert package in readme and package in ci, package


def test_modules_panel_shows_the_report_rows(qtbot):
    """The Modules panel lists the report's per-module rows (analysis/modules.py); none for foreign files."""
    from tracekit_gui.modules_panel import ModulesPanel

    table = {"rows": [{"module": "mlp", "pass": "backward", "bytes_at_peak": 2 << 20, "peak_bytes": 3 << 20},
                      {"module": "mlp.up", "pass": "forward", "bytes_at_peak": 1 << 20, "peak_bytes": 1 << 20}],
             "modules": 2, "layers": []}
    panel = ModulesPanel()
    qtbot.addWidget(panel)
    panel.set_table(table)
    cells = [[panel.table.item(r, c).text() for c in range(4)] for r in range(panel.table.rowCount())]
    assert cells == [["mlp", "backward", "2.0 MiB", "3.0 MiB"], ["mlp.up", "forward", "1.0 MiB", "1.0 MiB"]]
    panel.set_table(None)
    assert panel.table.rowCount() == 0 and "no module" in panel.caption.text()


def test_summary_line_says_what_an_oomd_run_needed(window, qtbot):
    """Issue 23: a run that ran out of memory shows what it needed at least (live + the failed request) beside
    its peak, in red, as the report and `check` say it."""
    from tracekit.analysis.report import build_report
    from tracekit.io import load
    from tracekit.units import fmt_bytes

    path = ROOT / "samples" / "oom_cuda.pickle"
    view = open_and_wait(window, qtbot, path)
    need = build_report(load(path))["devices"][0]["demand_bytes"]
    assert f"out of memory: needed <b>≥ {fmt_bytes(need)}</b>" in view.summary.text()
    clean = open_and_wait(window, qtbot, ROOT / "samples" / "gpt_adamw_cuda.pickle")
    assert "out of memory" not in clean.summary.text()


# ---- Hugging Face models recorded with torch's own API (issue 22) ----------------------------------

CUDA = ROOT / "tests" / "fixtures" / "cuda"


@needs(CUDA / "qwen2_amp_adamw_b4_s256.pickle.gz")
def test_torch_recorded_training_groups_by_library_line_and_module(window, qtbot):
    from tracekit_gui.tables import LIBRARY

    view = open_and_wait(window, qtbot, CUDA / "qwen2_amp_adamw_b4_s256.pickle.gz")
    lib = view.doc.device_report(view.device)["library_sites_at_peak"][0]["library_frame"]
    # the Library line column of the largest allocations names the model's line
    texts = {view.model.index(r, LIBRARY).data() for r in range(min(40, view.model.rowCount()))}
    assert any(f"modeling_qwen2.py:{lib['line']} in forward (transformers)" in t for t in texts)
    view.group_by("library")
    assert view.table.model() is view.groups and view.groups.rowCount() > 5
    keys = [view.groups.index(r, 4).data() for r in range(view.groups.rowCount())]
    assert any("modeling_qwen2.py" in k for k in keys)
    # sizes of the groups add up to the allocations they group
    al = view.doc.replays[view.device].allocations
    assert int(view.groups.bytes.sum()) == int(al.size.sum())
    # double-click a group: its allocations, all of that library line
    row = next(r for r, k in enumerate(keys) if "modeling_qwen2.py" in k)
    view._double_clicked(view.groups.index(row, 0))
    assert view.table.model() is view.model and 0 < view.model.rowCount() < len(al)
    assert {view.model.index(r, LIBRARY).data() for r in range(view.model.rowCount())} == {keys[row]}
    view.group_by("module")
    assert view.groups.rowCount() > 10
    assert view.modules.table.rowCount() > 0 and "stacks" in view.modules.caption.text()
    assert any(view.model.mod_strings[i].startswith("model.layers.3") for i in range(len(view.model.mod_strings)))


@needs(CUDA / "qwen2_generate_b2_p256_n128.pickle.gz")
def test_generation_shows_prefill_steps_and_the_kv_cache(window, qtbot):
    view = open_and_wait(window, qtbot, CUDA / "qwen2_generate_b2_p256_n128.pickle.gz")
    names = [s[0] for s in view.doc.phase_spans(view.device)]
    assert names[0] == "prefill" and names[1] == "step 1" and names[-1] == "step 127"
    assert view.timeline.kv.isVisible()
    x, y = view.doc.kv_series(view.device)
    assert int(y.max()) == view.doc.device_report(view.device)["kv_cache"]["bytes_max"]
    assert "decoding step" in view.doc.phase_at(view.device, len(view.doc.replays[view.device].allocated) // 2)
    assert view.findings.count() >= 1


@needs(CUDA / "opt_amp_adamw_b4_s256.pickle.gz")
def test_inspector_names_the_library_line_and_module(window, qtbot):
    view = open_and_wait(window, qtbot, CUDA / "opt_amp_adamw_b4_s256.pickle.gz")
    al = view.doc.replays[view.device].allocations
    strings, ids = view.doc.library_table(view.device)
    row = int(next(r for r in np.argsort(-al.size) if strings[ids[r]] and "modeling_opt.py" in strings[ids[r]]))
    view.select_allocation(row)
    text = view.inspector.text.toPlainText()
    assert "library    " in text and "modeling_opt.py" in text and "module     " in text
