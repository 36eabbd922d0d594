"""Breakdown panel: bytes by category at the cursor and at the peak."""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QLabel, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget, QHeaderView

from .palette import category_color, fmt_bytes


class BreakdownPanel(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.caption = QLabel("Hover or click the timeline.")
        self.caption.setWordWrap(True)
        self.table = QTableWidget(0, 3)
        self.table.setHorizontalHeaderLabels(["Category", "At cursor", "At peak"])
        self.table.verticalHeader().hide()
        self.table.verticalHeader().setDefaultSectionSize(21)
        self.table.setEditTriggers(QTableWidget.NoEditTriggers)
        self.table.setSelectionMode(QTableWidget.NoSelection)
        self.table.horizontalHeader().setSectionResizeMode(0, QHeaderView.Stretch)
        for c in (1, 2):
            self.table.horizontalHeader().setSectionResizeMode(c, QHeaderView.ResizeToContents)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.caption)
        layout.addWidget(self.table, 1)
        self.names, self.peak = [], {}

    def set_categories(self, names, peak: dict, reserved_at_peak=None):
        """Rows for every category (+ total, reserved); the peak column filled from the report."""
        self.names, self.peak = list(names), dict(peak)
        rows = self.names + ["total allocated", "reserved"]
        self.table.setRowCount(len(rows))
        for r, name in enumerate(rows):
            item = QTableWidgetItem(name.replace("_", " "))
            if r < len(self.names):
                item.setData(Qt.DecorationRole, QColor(category_color(name, self.names)))
            else:
                font = item.font()
                font.setBold(True)
                item.setFont(font)
            self.table.setItem(r, 0, item)
        self.table.setMinimumHeight(self.table.horizontalHeader().height() + 21 * len(rows) + 6)
        total = sum(self.peak.values()) if self.peak else None
        self._fill(2, self.peak, total, reserved_at_peak)
        self._fill(1, {}, None, None)

    def set_cursor(self, caption, parts: dict, reserved=None):
        self.caption.setText(caption)
        self._fill(1, parts, sum(parts.values()) if parts else None, reserved)

    def _fill(self, col, parts, total, reserved):
        values = [parts.get(n, 0 if parts else None) for n in self.names] + [total, reserved]
        for r, v in enumerate(values):
            item = QTableWidgetItem("—" if v == 0 else "" if v is None else fmt_bytes(v))
            item.setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
            if v is not None:
                item.setToolTip(f"{int(v):,} bytes")
            self.table.setItem(r, col, item)

    def cell(self, name, col) -> str:
        """Text of a category's row in a column (for tests)."""
        rows = self.names + ["total allocated", "reserved"]
        return self.table.item(rows.index(name), col).text()
