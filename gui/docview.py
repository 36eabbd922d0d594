"""One tab: a loaded file's timeline, breakdown, findings, allocations and inspector."""
from __future__ import annotations

import html
import os

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (QAbstractItemView, QCheckBox, QComboBox, QGroupBox, QHBoxLayout, QHeaderView, QLabel,
                               QLineEdit, QProgressBar, QPushButton, QSplitter, QTableView, QTabWidget, QVBoxLayout,
                               QWidget)

from .breakdown import BreakdownPanel
from .modules_panel import ModulesPanel
from .findings import FindingsList
from .inspector import Inspector
from .palette import fmt_bytes
from .tables import GROUPABLE, ROW_ROLE, AllocationsModel, GroupsModel
from .timeline import TimelineWidget


def _boxed(title, widget):
    box = QGroupBox(title)
    layout = QVBoxLayout(box)
    layout.setContentsMargins(2, 2, 2, 2)
    layout.addWidget(widget)
    return box


class LoadingView(QWidget):
    """Shown in a tab while its file loads: progress and a Cancel button."""

    def __init__(self, path, parent=None):
        super().__init__(parent)
        self.path = path
        self.message = QLabel(f"Opening {path} …")
        self.bar = QProgressBar()
        self.bar.setRange(0, 1000)
        self.cancel_button = QPushButton("Cancel")
        layout = QVBoxLayout(self)
        layout.addStretch(1)
        for w in (self.message, self.bar, self.cancel_button):
            layout.addWidget(w, 0, Qt.AlignHCenter)
        self.bar.setMinimumWidth(420)
        layout.addStretch(1)

    def set_progress(self, fraction, message):
        self.bar.setValue(int(fraction * 1000))
        self.message.setText(f"{os.path.basename(self.path)}: {message}")


class DocumentView(QWidget):
    status = Signal(str)  # a line for the status bar

    def __init__(self, doc, parent=None):
        super().__init__(parent)
        self.doc = doc
        self.device = doc.default_device()
        self.cursor_index = None

        self.device_box = QComboBox()
        for d in doc.devices:
            self.device_box.addItem(doc.label(d), d)
        self.device_box.setCurrentIndex(doc.devices.index(self.device))
        self.device_box.currentIndexChanged.connect(lambda i: self.set_device(self.device_box.itemData(i)))
        self.summary = QLabel()
        self.summary.setTextFormat(Qt.RichText)
        reset = QPushButton("Reset zoom")
        reset.setToolTip("Show the whole trace (Ctrl+0)")
        reset.clicked.connect(lambda: self.timeline.reset_zoom())
        top = QHBoxLayout()
        self.device_label = QLabel("Device:")
        top.addWidget(self.device_label)
        top.addWidget(self.device_box)
        top.addSpacing(12)
        top.addWidget(self.summary, 1)
        top.addWidget(reset)

        self.timeline = TimelineWidget()
        self.breakdown = BreakdownPanel()
        self.modules = ModulesPanel()  # per nn.Module (issue 11)
        self.findings = FindingsList()
        self.inspector = Inspector()
        self.model = AllocationsModel(self)
        self.groups = GroupsModel(self)
        self.table = QTableView()
        self.table.setModel(self.model)
        self.table.setSortingEnabled(True)
        self.table.horizontalHeader().setSortIndicator(0, Qt.DescendingOrder)
        self.table.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SingleSelection)
        self.table.verticalHeader().hide()
        self.table.verticalHeader().setDefaultSectionSize(22)
        self.table.setAlternatingRowColors(True)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.Interactive)
        self._column_widths()
        self.table.doubleClicked.connect(self._double_clicked)

        self.filter_edit = QLineEdit(placeholderText="Filter: category, file or function…", clearButtonEnabled=True)
        self.category_box = QComboBox()
        self.group_box = QComboBox()
        self.group_box.addItem("No grouping", None)
        for col, what in GROUPABLE.items():
            self.group_box.addItem(f"Group by {what}", col)
        self.group_box.setToolTip("One row per line of your code, library line (transformers, peft, ...) or module; "
                                  "double-click a group to list its allocations")
        self.group_box.currentIndexChanged.connect(lambda *_: self._regroup())
        self.live_box = QCheckBox("Live at cursor")
        self.live_box.setToolTip("Only allocations live at the pinned cursor (click the timeline to pin it)")
        self.count_label = QLabel()
        self._filter_timer = QTimer(self, singleShot=True, interval=150, timeout=self._apply_filter)
        self.filter_edit.textChanged.connect(lambda *_: self._filter_timer.start())
        self.category_box.currentIndexChanged.connect(lambda *_: self._apply_filter())
        self.live_box.toggled.connect(lambda *_: self._apply_filter())
        bar = QHBoxLayout()
        bar.setContentsMargins(0, 0, 0, 0)
        bar.addWidget(self.filter_edit, 1)
        bar.addWidget(self.category_box)
        bar.addWidget(self.group_box)
        bar.addWidget(self.live_box)
        bar.addWidget(self.count_label)
        allocations = QWidget()
        al_layout = QVBoxLayout(allocations)
        al_layout.setContentsMargins(0, 0, 0, 0)
        al_layout.addLayout(bar)
        al_layout.addWidget(self.table, 1)

        side = QSplitter(Qt.Vertical)
        side.addWidget(_boxed("Breakdown", self.breakdown))
        side.addWidget(_boxed("Findings", self.findings))
        side.setSizes([250, 330])
        upper = QSplitter(Qt.Horizontal)
        upper.addWidget(self.timeline)
        upper.addWidget(side)
        upper.setStretchFactor(0, 1)
        upper.setSizes([960, 420])
        # the allocations and the per-module table share the lower left: both list what holds the memory
        self.tabs = QTabWidget()
        self.tabs.addTab(allocations, "Allocations")
        self.tabs.addTab(self.modules, "Modules")
        lower = QSplitter(Qt.Horizontal)
        lower.addWidget(self.tabs)
        lower.addWidget(_boxed("Inspector", self.inspector))
        lower.setSizes([940, 440])
        self.splitter = QSplitter(Qt.Vertical)
        self.splitter.addWidget(upper)
        self.splitter.addWidget(lower)
        self.splitter.setStretchFactor(0, 3)
        self.splitter.setSizes([560, 300])
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)
        layout.addLayout(top)
        layout.addWidget(self.splitter, 1)
        self.device_box.setVisible(len(doc.devices) > 1)
        self.device_label.setVisible(len(doc.devices) > 1)

        self._pending_hover = None
        self._hover_timer = QTimer(self, singleShot=True, interval=40, timeout=self._show_hover)
        self.timeline.hovered.connect(self._hovered)
        self.timeline.clicked.connect(self.pin_cursor)
        self.timeline.finding_clicked.connect(self.findings.select_finding)
        self.findings.selected.connect(self.select_finding)
        self.table.selectionModel().currentRowChanged.connect(lambda cur, _: self._row_selected(cur))
        self.set_device(self.device)

    # ---- device ---------------------------------------------------------------------

    def set_device(self, device):
        self.device = device
        doc = self.doc
        rep = doc.replays[device]
        info = doc.device_report(device)
        names = doc.category_names(device)
        self.timeline.set_document(doc, device)
        at_peak = info.get("categories_at_peak") or doc.breakdown_at(device, rep.peak_index)
        self.breakdown.set_categories(self.timeline.present_names, at_peak,
                                      rep.reserved_at(rep.peak_index))
        self.findings.set_findings(doc.findings(device))
        self.modules.set_table(info.get("modules"))
        self.inspector.clear()
        self.cursor_index = None
        self.category_box.blockSignals(True)
        self.category_box.clear()
        self.category_box.addItem("All categories", None)
        for n in names:
            self.category_box.addItem(n.replace("_", " "), n)
        self.category_box.blockSignals(False)
        self.model.set_document(doc, device)
        self._regroup()
        modules = info.get("modules")
        self.tabs.setTabText(1, f"Modules ({modules['modules']})" if modules else "Modules")
        self._update_count()
        head = info.get("headline_peak") or {"bytes": rep.peak_allocated, "index": rep.peak_index}
        peak_at = f"entry {head['index']:,}" if head["index"] >= 0 else "before the trace"
        if head["index"] >= 0 and doc.has_time(device):
            peak_at += f", {doc.x_of(device, head['index']):.3f} s"
        if head.get("measure"):  # the report's words: the allocator's counter, requested bytes beside it
            from tracekit.render.text import headline_words

            peak_at = f"{headline_words(head)}; {peak_at}"
        reserved = f" · peak reserved <b>{fmt_bytes(rep.peak_reserved)}</b>" if rep.peak_reserved is not None else ""
        if info.get("demand_is_lower_bound"):  # the run died: what it needed is at least this (analysis/oom.py)
            reserved += (f" · <span style='color:#C00000'>out of memory: needed <b>≥ {fmt_bytes(info['demand_bytes'])}"
                         f"</b></span>")
        self.summary.setText(f"<b>{doc.label(device)}</b> · peak allocated <b>{fmt_bytes(head['bytes'])}</b> ({peak_at}){reserved}"
                             f" · {rep.n:,} entries · {len(rep.allocations):,} allocations{self._window_text()}")
        self.status.emit(self.status_text())

    def _window_text(self) -> str:
        """" · window: the last 10 s" when the file was opened cut to a window."""
        from tracekit.analysis.window import read_note

        cut = self.doc.trace.meta.get("window")
        if not cut:
            self.summary.setToolTip("")
            return ""
        # how the window was read is a sentence: in the tooltip, so the summary line keeps the window's width
        note = read_note(cut)
        self.summary.setToolTip(f"window: {cut['description']}" + (f"; {note}" if note else ""))
        return f" · window: {html.escape(cut['description'])}" + (" (hover: how it was read)" if note else "")

    def status_text(self, extra=""):
        name = os.path.basename(self.doc.path)
        return f"{name} · {self.doc.label(self.device)}" + (f" · {extra}" if extra else "")

    # ---- timeline cursor ------------------------------------------------------------------

    def _hovered(self, index):
        self._pending_hover = index
        if not self._hover_timer.isActive():
            self._hover_timer.start()

    def _show_hover(self):
        if self._pending_hover is not None:
            self._show_breakdown(self._pending_hover, "Under the mouse")

    def pin_cursor(self, index):
        """Pin the cursor at a trace entry: breakdown there, and the table's "live at cursor" filter."""
        self.cursor_index = max(int(index), -1)
        self.timeline.set_cursor(max(self.cursor_index, 0))
        self._show_breakdown(self.cursor_index, "Pinned")
        if self.live_box.isChecked():
            self._apply_filter()

    def _show_breakdown(self, index, what):
        doc, d = self.doc, self.device
        parts = doc.breakdown_at(d, index)
        rep = doc.replays[d]
        where = "before the first entry" if index < 0 else f"entry {index:,}"
        if index >= 0 and doc.has_time(d):
            where += f" ({doc.x_of(d, index):.4f} s)"
        phase = doc.phase_at(d, index)
        self.breakdown.set_cursor(f"{what}: {where}" + (f" · {phase}" if phase else ""), parts, rep.reserved_at(index))
        self.status.emit(self.status_text(f"{where}: {fmt_bytes(rep.allocated_at(index))} allocated"))

    # ---- selection --------------------------------------------------------------------------

    def _column_widths(self):
        if self.table.model() is self.groups:
            for col, width in enumerate((85, 60, 85, 120, 600)):
                self.table.setColumnWidth(col, width)
        else:
            # your line and the library line share what the fixed columns leave of the table's width, so both
            # show (Module and Address are a scroll away) instead of the library line being cut at the edge
            fixed = (80, 110, 125, 125, 85)
            room = max(self.table.viewport().width() - sum(fixed) - 4, 440)
            for col, width in enumerate(fixed + (int(room * 0.42), room - int(room * 0.42), 260, 130)):
                self.table.setColumnWidth(col, width)

    def showEvent(self, event):
        super().showEvent(event)
        if not getattr(self, "_fitted", False):  # once the table has its real width
            self._fitted = True
            self._column_widths()

    def _regroup(self):
        """Show the allocations, or their groups by your line / library line / module."""
        column = self.group_box.currentData()
        want = self.groups if column is not None else self.model
        if column is not None:
            self.groups.set_groups(self.model, column)
        if self.table.model() is not want:
            self.table.setModel(want)
            self.table.selectionModel().currentRowChanged.connect(lambda cur, _: self._row_selected(cur))
            self.table.horizontalHeader().setSortIndicator(0, Qt.DescendingOrder)
            self._column_widths()
        self._update_count()

    def group_by(self, what):
        """Group the table by "line" (your line), "library" (library line) or "module"; None: no grouping."""
        from .tables import LIBRARY, MODULE, WHERE

        column = {"line": WHERE, "library": LIBRARY, "module": MODULE}.get(what)
        i = self.group_box.findData(column) if column is not None else 0
        self.group_box.setCurrentIndex(max(i, 0))

    def _double_clicked(self, index):
        """A group: list its allocations (the group filter, which the filter bar's text keeps)."""
        if self.table.model() is not self.groups or not index.isValid():
            return
        column, gid = self.groups.column, self.groups.group_of(index.row())
        self.group_box.blockSignals(True)
        self.group_box.setCurrentIndex(0)
        self.group_box.blockSignals(False)
        self.model.set_filter(text=self.filter_edit.text(), category=self.category_box.currentData(),
                              live_at=self._live_at(), group=(column, gid))
        self._regroup()

    def _live_at(self):
        return self.cursor_index if self.live_box.isChecked() and self.cursor_index is not None else None

    def _row_selected(self, current):
        if not current.isValid():
            return
        row = current.model().data(current, ROW_ROLE)
        if row is None or row < 0:
            return
        al = self.doc.replays[self.device].allocations
        category = self.model.category_of(row)
        self.inspector.show_allocation(self.doc, self.device, row, category, self.model.method_of(row))
        a, f = int(al.alloc_index[row]), int(al.free_index[row])
        if not self.timeline.region_in_view(a, f):  # bring it into view, whole
            last = self.doc.replays[self.device].n - 1
            self.timeline.show_entries(max(a, 0), f if f >= 0 else last)
        self.timeline.highlight(a, f, int(al.size[row]), category.replace("_", " "))

    def select_allocation(self, allocation_row):
        """Select an allocation (its row in the replay's allocations) in the table, if shown."""
        if self.table.model() is not self.model:
            self.group_box.setCurrentIndex(0)
        view_row = self.model.view_row_of(allocation_row)
        if view_row >= 0:
            self.table.selectRow(view_row)
            self.table.scrollTo(self.model.index(view_row, 0))
        return view_row

    def select_finding(self, i):
        f = self.doc.findings(self.device)[i]
        self.inspector.show_finding(f)
        start, end, index = f.get("start_index"), f.get("end_index"), f.get("index")
        if start is not None and end is not None:
            self.timeline.show_entries(start, end)
        elif index is not None:
            self.timeline.show_entries(index)
        if index is not None:
            self.pin_cursor(index)

    # ---- table filter --------------------------------------------------------------------------

    def _apply_filter(self):
        self.model.set_filter(text=self.filter_edit.text(), category=self.category_box.currentData(),
                              live_at=self._live_at(), group=None)
        self._regroup()

    def _update_count(self):
        total = len(self.doc.replays[self.device].allocations)
        if total == 0 and not self.doc.trace.meta.get("has_addresses", True):
            self.count_label.setText("no allocations: this file records sizes but no addresses")
        elif self.table.model() is self.groups:
            self.count_label.setText(f"{self.groups.rowCount():,} groups")
        else:
            one = self.model.filter_group
            group = ""
            if one is not None:
                strings = self.model.ids_of(one[0])[0]
                group = f" · one group: {strings[one[1]] or 'none'}"[:90]
            self.count_label.setText(f"{self.model.rowCount():,} of {total:,}{group}")
