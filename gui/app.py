"""The main window: tabs of opened files, menus, shortcuts, recent files, drag and drop."""
from __future__ import annotations

import os
import sys

from PySide6.QtCore import QByteArray, QSettings, Qt, QTimer, qInstallMessageHandler
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (QApplication, QFileDialog, QLabel, QMainWindow, QMessageBox, QPushButton, QTabBar,
                               QTabWidget, QVBoxLayout, QWidget)

from tracekit.errors import TracekitError

from . import display, export
from .docview import DocumentView, LoadingView
from .loader import LoadThread

MAX_RECENT = 10
FILE_FILTER = "Memory files (*.pickle *.pkl *.json *.gz *.pt.trace.json);;All files (*)"


def settings() -> QSettings:
    """The viewer's settings; $TRACEKIT_SETTINGS names an INI file instead (tests, portable installs)."""
    path = os.environ.get("TRACEKIT_SETTINGS")
    return QSettings(path, QSettings.IniFormat) if path else QSettings("tracekit", "tracekit-viewer")


class Welcome(QWidget):
    """The page shown when no file is open: what to do, an Open button and the recent files."""

    def __init__(self, window, parent=None):
        super().__init__(parent)
        self.window = window
        text = QLabel("<h2>tracekit</h2><p>Open a PyTorch memory snapshot or profiler trace "
                      "(<b>File ▸ Open</b>, Ctrl+O), or drop files here.</p>"
                      "<p>Make one with <code>tracekit record -- python train.py</code>, "
                      "or <code>torch.cuda.memory._dump_snapshot()</code>.</p>")
        text.setAlignment(Qt.AlignCenter)
        open_button = QPushButton("Open a file…")
        open_button.clicked.connect(window.open_dialog)
        self.recent = QVBoxLayout()
        layout = QVBoxLayout(self)
        layout.addStretch(1)
        layout.addWidget(text)
        layout.addWidget(open_button, 0, Qt.AlignHCenter)
        layout.addLayout(self.recent)
        layout.addStretch(1)

    def showEvent(self, event):
        while self.recent.count():
            self.recent.takeAt(0).widget().deleteLater()
        files = self.window.recent_files()[:5]
        if files:
            self.recent.addWidget(QLabel("Recent:"), 0, Qt.AlignHCenter)
        for path in files:
            button = QPushButton(path, flat=True)
            button.setStyleSheet("color: #0072B2; text-align: center")
            button.clicked.connect(lambda _=False, p=path: self.window.open_file(p))
            self.recent.addWidget(button, 0, Qt.AlignHCenter)
        super().showEvent(event)


class MainWindow(QMainWindow):
    def __init__(self, remember=True):
        super().__init__()
        self.remember = remember  # False: leave settings untouched (screenshots)
        self.threads: dict = {}  # LoadingView -> LoadThread
        self.last_error = None  # the last message shown in an error dialog
        self.error_box = None
        self.setWindowTitle("tracekit")
        self.setAcceptDrops(True)
        self.tabs = QTabWidget(tabsClosable=True, movable=True, documentMode=True)
        self.tabs.tabCloseRequested.connect(self.close_tab)
        self.welcome = Welcome(self)
        self._ensure_welcome()
        self.setCentralWidget(self.tabs)
        self.file_label = QLabel()
        self.statusBar().addPermanentWidget(self.file_label)
        self._build_menus()
        self.tabs.currentChanged.connect(self._tab_changed)
        self.resize(1440, 900)
        if remember:
            s = settings()
            geometry, state = s.value("geometry"), s.value("state")
            if isinstance(geometry, QByteArray):
                self.restoreGeometry(geometry)
            if isinstance(state, QByteArray):
                self.restoreState(state)

    # ---- menus ----------------------------------------------------------------------------------

    def _action(self, menu, text, slot, shortcut=None, tip=None):
        action = QAction(text, self)
        if shortcut:
            keys = shortcut if isinstance(shortcut, (list, tuple)) else [shortcut]
            action.setShortcuts([QKeySequence(k) for k in keys])
        if tip:
            action.setStatusTip(tip)
        action.triggered.connect(slot)
        menu.addAction(action)
        return action

    def _build_menus(self):
        m = self.menuBar().addMenu("&File")
        self._action(m, "&Open…", self.open_dialog, "Ctrl+O", "Open memory snapshots or profiler traces")
        self._action(m, "&Compare Two Files…", self.compare_dialog, "Ctrl+Shift+O",
                     "Compare two recordings on one axis (phase and iteration) and see what changed")
        self._action(m, "Open Ran&k Folder…", self.ranks_dialog, None, "One job's rank files side by side")
        self.recent_menu = m.addMenu("Open &Recent")
        self.recent_menu.aboutToShow.connect(self._fill_recent)
        m.addSeparator()
        self.export_png_action = self._action(m, "Export Timeline as &PNG…", self.export_png, "Ctrl+Shift+P")
        self.export_csv_action = self._action(m, "Export Allocations as &CSV…", self.export_csv, "Ctrl+Shift+C")
        m.addSeparator()
        self._action(m, "&Close Tab", lambda: self.close_tab(self.tabs.currentIndex()), ["Ctrl+W", "Ctrl+F4"])
        self._action(m, "&Quit", self.close, "Ctrl+Q")
        v = self.menuBar().addMenu("&View")
        self._action(v, "Zoom &In", lambda: self._timeline_do("zoom", 0.5), ["Ctrl++", "Ctrl+="])
        self._action(v, "Zoom &Out", lambda: self._timeline_do("zoom", 2.0), "Ctrl+-")
        self._action(v, "&Reset Zoom", lambda: self._timeline_do("reset_zoom"), "Ctrl+0")
        self._action(v, "Jump to &Peak", self._jump_to_peak, "Ctrl+P")
        self._action(v, "&Estimate Memory…", self.show_estimate, "Ctrl+E", "Napkin math beside the open recording")
        self._action(v, "&Allocator and Fragmentation…", self.show_allocator, "Ctrl+Shift+A",
                     "Reserved vs allocated as the caching allocator counts them, its segments, and what-ifs")
        h = self.menuBar().addMenu("&Help")
        self._action(h, "&How to read this", self._help)

    def _help(self):
        QMessageBox.information(self, "tracekit viewer", (
            "The timeline shows allocated memory stacked by category; the dashed line is reserved memory "
            "(what the caching allocator holds). Markers show the peak, spikes, leaks and OOMs: click one, "
            "or a finding on the right, to jump there.\n\n"
            "Mouse wheel zooms, drag pans. Hover to see the breakdown under the mouse; click to pin the cursor "
            "(and tick 'Live at cursor' to list what was live there).\n\n"
            "Select an allocation to see its lifetime on the timeline and its stack, your own code first."))

    # ---- opening ------------------------------------------------------------------------------------

    def open_dialog(self):
        paths, _ = QFileDialog.getOpenFileNames(self, "Open memory files", self._last_dir(), FILE_FILTER)
        for p in paths:
            self.open_picking_window(p)

    def open_picking_window(self, path):
        """Open `path`; a big one first gets a quick first pass and the window picker (gui/window_picker.py).
        Returns the tab's loading view, or None when the picker was cancelled."""
        from tracekit.analysis.survey import survey

        from .window_picker import is_big, pick_window

        QApplication.setOverrideCursor(Qt.WaitCursor)
        try:
            facts = survey(path)
        except OSError:
            facts = None  # open_file says what is wrong with it
        finally:
            QApplication.restoreOverrideCursor()
        if facts is None or not is_big(facts):
            return self.open_file(path)
        accepted, window = pick_window(facts, self)
        return self.open_file(path, window=window) if accepted else None

    def compare_dialog(self):
        paths, _ = QFileDialog.getOpenFileNames(self, "Compare two recordings (A before, B after)", self._last_dir(),
                                                FILE_FILTER)
        if len(paths) == 2:
            self.open_compare(*sorted(paths))
        elif paths:
            self.show_error("Compare", "Pick exactly two files: A (before) and B (after).")

    def ranks_dialog(self):
        folder = QFileDialog.getExistingDirectory(self, "Open the rank files of one job", self._last_dir())
        if folder:
            self.open_ranks(folder)

    def open_compare(self, path_a, path_b):
        """A tab comparing two files (gui/compare.py)."""
        from .compare import start_compare

        return start_compare(self, os.path.abspath(path_a), os.path.abspath(path_b))

    def open_ranks(self, folder):
        """A rank dashboard tab for a folder of rank files (gui/ranks.py)."""
        from .ranks import start_ranks

        return start_ranks(self, os.path.abspath(folder))

    def _last_dir(self):
        recent = self.recent_files()
        return os.path.dirname(recent[0]) if recent else os.getcwd()

    def open_file(self, path, use_cache=True, window=None) -> LoadingView:
        """Start loading `path` (cut to `window`, if given) in a new tab, in the background; returns the tab's
        loading view."""
        path = os.path.abspath(os.fspath(path))
        view = LoadingView(path)
        index = self.tabs.addTab(view, os.path.basename(path))
        self.tabs.setTabToolTip(index, path)
        self.tabs.setCurrentIndex(index)
        if self.tabs.indexOf(self.welcome) >= 0:
            self.tabs.removeTab(self.tabs.indexOf(self.welcome))
        thread = LoadThread(path, use_cache=use_cache, window=window)
        thread.progress.connect(view.set_progress)
        thread.loaded.connect(lambda doc: self._loaded(view, doc))
        thread.failed.connect(lambda msg: self._failed(view, msg))
        thread.cancelled.connect(lambda: self._drop(view, "cancelled"))
        view.cancel_button.clicked.connect(thread.cancel)
        self.threads[view] = thread
        thread.start()
        return view

    def _loaded(self, view, doc):
        self._forget_thread(view)
        index = self.tabs.indexOf(view)
        if index < 0:  # the tab was closed while loading
            return
        dv = DocumentView(doc)
        dv.status.connect(self.statusBar().showMessage)
        self.tabs.removeTab(index)
        self.tabs.insertTab(index, dv, os.path.basename(doc.path))
        self.tabs.setTabToolTip(index, doc.path)
        self.tabs.setCurrentIndex(index)
        view.deleteLater()
        self.add_recent(doc.path)
        self._tab_changed(index)

    def _failed(self, view, message):
        self._drop(view, "failed")
        self.show_error("Cannot open file", message)

    def _drop(self, view, why):
        self._forget_thread(view)
        index = self.tabs.indexOf(view)
        if index >= 0:
            self.tabs.removeTab(index)
            view.deleteLater()
        self.statusBar().showMessage(f"{os.path.basename(view.path)}: {why}", 5000)
        self._ensure_welcome()

    def _forget_thread(self, view):
        thread = self.threads.pop(view, None)
        if thread is not None:
            thread.wait()
            thread.deleteLater()

    def show_error(self, title, message):
        """A non-blocking error dialog with the loader's message (kept in `last_error`)."""
        self.last_error = message
        self.error_box = QMessageBox(QMessageBox.Critical, title, message, QMessageBox.Ok, self)
        self.error_box.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.error_box.open()

    def close_tab(self, index):
        widget = self.tabs.widget(index)
        if widget is None or widget is self.welcome:
            return
        if isinstance(widget, LoadingView) and widget in self.threads:
            self.threads[widget].cancel()  # its cancelled signal removes the tab
            return
        self.tabs.removeTab(index)
        widget.deleteLater()
        self._ensure_welcome()

    def _ensure_welcome(self):
        if self.tabs.count() == 0:
            index = self.tabs.addTab(self.welcome, "Welcome")
            self.tabs.tabBar().setTabButton(index, QTabBar.RightSide, None)  # the welcome page stays

    # ---- current document ---------------------------------------------------------------------------

    def current_view(self) -> DocumentView | None:
        w = self.tabs.currentWidget()
        return w if isinstance(w, DocumentView) else None

    def document_views(self) -> list[DocumentView]:
        return [w for w in (self.tabs.widget(i) for i in range(self.tabs.count())) if isinstance(w, DocumentView)]

    def _tab_changed(self, index):
        view = self.current_view()
        self.export_png_action.setEnabled(view is not None)
        self.export_csv_action.setEnabled(view is not None)
        if view is not None:
            self.setWindowTitle(f"{os.path.basename(view.doc.path)} — tracekit")
            self.file_label.setText(f"{view.doc.path}")
            self.statusBar().showMessage(view.status_text())
        else:
            self.setWindowTitle("tracekit")
            self.file_label.setText("")

    def _timeline_do(self, method, *args):
        view = self.current_view()
        if view is not None:
            getattr(view.timeline, method)(*args)

    def show_estimate(self):
        """The estimate panel (gui/estimate_panel.py), for the open recording if there is one."""
        from .estimate_panel import show

        view = self.current_view()
        self.estimate_panel = show(view.doc.trace if view else None, view.device if view else None, self)

    def show_allocator(self):
        """The allocator window (gui/fragmentation.py) for the open recording's device."""
        from .fragmentation import show

        view = self.current_view()
        if view is not None:
            self.allocator_panel = show(view.doc, view.device, self)
        return getattr(self, "allocator_panel", None)

    def _jump_to_peak(self):
        view = self.current_view()
        if view is not None:
            peak = view.doc.replays[view.device].peak_index
            view.timeline.show_entries(max(peak, 0))
            view.pin_cursor(peak)

    # ---- export ------------------------------------------------------------------------------------

    def export_png(self, path=None):
        view = self.current_view()
        if view is None:
            return None
        if not path:
            base = os.path.splitext(os.path.basename(view.doc.path))[0]
            path, _ = QFileDialog.getSaveFileName(self, "Export timeline", f"{base}-timeline.png", "PNG (*.png)")
        if path:
            try:
                export.save_png(view.timeline, path)
                self.statusBar().showMessage(f"Saved {path}", 5000)
            except TracekitError as e:
                self.show_error("Export failed", str(e))
        return path

    def export_csv(self, path=None):
        view = self.current_view()
        if view is None:
            return None
        if not path:
            base = os.path.splitext(os.path.basename(view.doc.path))[0]
            path, _ = QFileDialog.getSaveFileName(self, "Export allocations", f"{base}-allocations.csv",
                                                  "CSV (*.csv)")
        if path:
            try:
                rows = export.save_csv(view.model, path)
                self.statusBar().showMessage(f"Saved {rows:,} allocations to {path}", 5000)
            except TracekitError as e:
                self.show_error("Export failed", str(e))
        return path

    # ---- recent files, drag and drop, closing ----------------------------------------------------------

    def recent_files(self) -> list[str]:
        value = settings().value("recent", [])
        if isinstance(value, str):
            value = [value]
        return [p for p in (value or []) if isinstance(p, str)]

    def add_recent(self, path):
        if not self.remember:
            return
        recent = [path] + [p for p in self.recent_files() if p != path]
        settings().setValue("recent", recent[:MAX_RECENT])

    def _fill_recent(self):
        self.recent_menu.clear()
        recent = self.recent_files()
        for p in recent:
            self.recent_menu.addAction(p, lambda p=p: self.open_file(p))
        if not recent:
            self.recent_menu.addAction("(none)").setEnabled(False)

    def dragEnterEvent(self, event):
        if event.mimeData().hasUrls():
            event.acceptProposedAction()

    def dropEvent(self, event):
        for url in event.mimeData().urls():
            if url.isLocalFile():
                self.open_file(url.toLocalFile())
        event.acceptProposedAction()

    def closeEvent(self, event):
        for view, thread in list(self.threads.items()):
            thread.cancel()
            thread.wait()
        if self.remember:
            s = settings()
            s.setValue("geometry", self.saveGeometry())
            s.setValue("state", self.saveState())
        super().closeEvent(event)


def wait_loaded(window, timeout_s=600) -> bool:
    """Process events until no file is loading (for screenshots and scripts)."""
    import time

    app = QApplication.instance()
    deadline = time.monotonic() + timeout_s
    while window.threads and time.monotonic() < deadline:
        app.processEvents()
        time.sleep(0.01)
    for _ in range(5):
        app.processEvents()
    return not window.threads


def _wait_exposed(window, timeout_s=20) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while not (window.windowHandle() and window.windowHandle().isExposed()) and time.monotonic() < deadline:
        QApplication.instance().processEvents()
        time.sleep(0.01)
    return window.windowHandle().isExposed()


def screenshot(files, out, size=(1440, 900), select=None, use_cache=True, compare=False,
               trace_window=None, allocator=None, group=None) -> int:
    """Open files in a window of `size`, render it and write a PNG. Returns an exit code.

    On a real display (xcb under Xvfb, say) the window is shown there and must be
    exposed by the display server before it is rendered. `select` ("leak", "spike",
    "peak", ...) selects the first finding of that kind first, as a click would; `group` ("line",
    "library", "module") groups the allocations table so."""
    app = QApplication.instance() or QApplication([sys.argv[0]])
    window = MainWindow(remember=False)
    window.resize(*size)
    window.show()
    if app.platformName() != "offscreen" and not _wait_exposed(window):
        print(f"tracekit: the window never appeared on the {app.platformName()} display", file=sys.stderr)
        return 2
    _open_all(window, files, compare, use_cache, trace_window)
    wait_loaded(window)
    if window.last_error or not (window.document_views() or window.tabs.currentWidget() is not window.welcome):
        print(f"tracekit: {window.last_error or 'nothing could be shown'}", file=sys.stderr)
        return 2
    for view in window.document_views():
        kinds = [f.get("kind") for f in view.doc.findings(view.device)]
        if select and select in kinds:
            view.findings.select_finding(kinds.index(select))
        if group:
            view.group_by(group)
        view.timeline.refresh()
    app.processEvents()
    if allocator is not None:  # the allocator window (gui/fragmentation.py), with a what-if if settings are given
        panel = window.show_allocator()
        if panel is None:
            print("tracekit: no recording to show the allocator of", file=sys.stderr)
            return 2
        if allocator:
            panel.conf.setText(allocator)
            panel.run_whatif()
        if app.platformName() != "offscreen":
            _wait_exposed(panel)
        for _ in range(10):
            app.processEvents()
        export.save_png(panel, out)
        window.close()
        return 0
    export.save_png(window, out)
    window.close()
    return 0


def _without_offscreen_noise(mode, context, message):
    """Qt's messages, less the offscreen plugin's harmless propagateSizeHints() complaint.

    Everything else (the platform plugin's hints above all) still reaches stderr."""
    if "propagateSizeHints" not in message:
        sys.stderr.write(message + "\n")


def _open_all(window, files, compare=False, use_cache=True, trace_window=None):
    """Files in tabs; two with `compare` side by side; a folder as a rank dashboard."""
    if compare and len(files) == 2:
        return window.open_compare(*files)
    for f in files:
        if os.path.isdir(f):
            window.open_ranks(f)
        else:
            window.open_file(f, use_cache=use_cache, window=trace_window)


def main(files=(), screenshot_path=None, select=None, use_cache=True, compare=False, trace_window=None,
         allocator=None, group=None) -> int:
    """Run the viewer on `files` (or render a screenshot and exit).

    Before Qt starts, checks that a window can open here; if not, says in one line
    what to install and returns 2."""
    if screenshot_path and not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # a screenshot needs no screen
    why = display.problem()
    if why:
        print(f"tracekit: {why}", file=sys.stderr)
        return 2
    qInstallMessageHandler(_without_offscreen_noise)
    if screenshot_path:
        return screenshot(files, screenshot_path, select=select, use_cache=use_cache, compare=compare,
                          trace_window=trace_window, allocator=allocator, group=group)
    app = QApplication.instance() or QApplication([sys.argv[0]])
    app.setApplicationName("tracekit")
    app.setOrganizationName("tracekit")
    window = MainWindow()
    window.show()
    QTimer.singleShot(0, lambda: _open_all(window, files, compare, use_cache, trace_window))
    return app.exec()
