"""One tab: a loaded file's timeline, breakdown, findings, allocations and inspector."""
from __future__ import annotations

import html
import os

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (QAbstractItemView, QCheckBox, QComboBox, QGroupBox, QHBoxLayout, QHeaderView, QLabel,
                               QLineEdit, QProgressBar, QPushButton, QSplitter, QTableView, QVBoxLayout, QWidget)

from .breakdown import BreakdownPanel
from .modules_panel import ModulesPanel
from .findings import FindingsList
from .inspector import Inspector
from .palette import fmt_bytes
from .tables import ROW_ROLE, AllocationsModel
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
        for col, width in enumerate((90, 130, 150, 150, 100, 380, 130)):
            self.table.setColumnWidth(col, width)

        self.filter_edit = QLineEdit(placeholderText="Filter: category, file or function…", clearButtonEnabled=True)
        self.category_box = QComboBox()
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
        side.addWidget(_boxed("Modules", self.modules))
        side.setSizes([300, 260, 200])
        upper = QSplitter(Qt.Horizontal)
        upper.addWidget(self.timeline)
        upper.addWidget(side)
        upper.setStretchFactor(0, 1)
        upper.setSizes([1000, 380])
        lower = QSplitter(Qt.Horizontal)
        lower.addWidget(_boxed("Allocations", allocations))
        lower.addWidget(_boxed("Inspector", self.inspector))
        lower.setSizes([900, 480])
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
        self._update_count()
        peak_at = f"entry {rep.peak_index:,}" if rep.peak_index >= 0 else "before the trace"
        if rep.peak_index >= 0 and doc.has_time(device):
            peak_at += f", {doc.x_of(device, rep.peak_index):.3f} s"
        reserved = f" · peak reserved <b>{fmt_bytes(rep.peak_reserved)}</b>" if rep.peak_reserved is not None else ""
        if info.get("demand_is_lower_bound"):  # the run died: what it needed is at least this (analysis/oom.py)
            reserved += (f" · <span style='color:#C00000'>out of memory: needed <b>≥ {fmt_bytes(info['demand_bytes'])}"
                         f"</b></span>")
        self.summary.setText(f"<b>{doc.label(device)}</b> · peak allocated <b>{fmt_bytes(rep.peak_allocated)}</b> ({peak_at}){reserved}"
                             f" · {rep.n:,} entries · {len(rep.allocations):,} allocations{self._window_text()}")
        self.status.emit(self.status_text())

    def _window_text(self) -> str:
        """" · window: the last 10 s" when the file was opened cut to a window."""
        cut = self.doc.trace.meta.get("window")
        return f" · window: {html.escape(cut['description'])}" if cut else ""

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

    def _row_selected(self, current):
        if not current.isValid():
            return
        row = self.model.data(current, ROW_ROLE)
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
        live = self.cursor_index if self.live_box.isChecked() and self.cursor_index is not None else None
        self.model.set_filter(text=self.filter_edit.text(), category=self.category_box.currentData(), live_at=live)
        self._update_count()

    def _update_count(self):
        total = len(self.doc.replays[self.device].allocations)
        if total == 0 and not self.doc.trace.meta.get("has_addresses", True):
            self.count_label.setText("no allocations: this file records sizes but no addresses")
        else:
            self.count_label.setText(f"{self.model.rowCount():,} of {total:,}")
