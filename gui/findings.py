"""The findings list (peak, spikes, leaks, fragmentation, OOM, advice) from the report."""
from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import QListWidget, QListWidgetItem

from .palette import FINDING_COLORS, fmt_bytes

ORDER = ("oom", "peak", "leak", "spike", "fragmentation", "advice")


class FindingsList(QListWidget):
    """One row per finding; `selected(i)` gives its position in Document.findings(device)."""

    selected = Signal(int)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setWordWrap(True)
        self.setAlternatingRowColors(True)
        self.currentRowChanged.connect(self._changed)

    def set_findings(self, findings):
        self.blockSignals(True)
        self.clear()
        ranked = sorted(range(len(findings)),
                        key=lambda i: (ORDER.index(findings[i].get("kind")) if findings[i].get("kind") in ORDER
                                       else len(ORDER), -(findings[i].get("bytes") or 0)))
        for i in ranked:
            f = findings[i]
            kind = f.get("kind", "")
            size = f" {fmt_bytes(f['bytes'])}" if f.get("bytes") is not None else ""
            item = QListWidgetItem(f"{kind.upper()}{size} — {f.get('summary', '')}")
            item.setData(Qt.UserRole, i)
            item.setForeground(QBrush(QColor(FINDING_COLORS.get(kind, "#000000")).darker(120)))
            item.setToolTip(f.get("summary", ""))
            self.addItem(item)
        if not findings:
            self.addItem(QListWidgetItem("No findings for this device."))
        self.blockSignals(False)

    def select_finding(self, i):
        for row in range(self.count()):
            if self.item(row).data(Qt.UserRole) == i:
                self.setCurrentRow(row)
                return

    def _changed(self, row):
        item = self.item(row) if row >= 0 else None
        if item is not None and item.data(Qt.UserRole) is not None:
            self.selected.emit(int(item.data(Qt.UserRole)))
