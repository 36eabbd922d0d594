"""Modules panel: bytes per nn.Module and pass at the peak, and the most each held (analysis/modules.py)."""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QHeaderView, QLabel, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget

from .palette import fmt_bytes


class ModulesPanel(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.caption = QLabel()
        self.caption.setWordWrap(True)
        self.table = QTableWidget(0, 4)
        self.table.setHorizontalHeaderLabels(["Module", "Pass", "At peak", "Most held"])
        self.table.verticalHeader().hide()
        self.table.verticalHeader().setDefaultSectionSize(21)
        self.table.setEditTriggers(QTableWidget.NoEditTriggers)
        self.table.setSelectionMode(QTableWidget.NoSelection)
        self.table.horizontalHeader().setSectionResizeMode(0, QHeaderView.Stretch)
        for c in (1, 2, 3):
            self.table.horizontalHeader().setSectionResizeMode(c, QHeaderView.ResizeToContents)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.caption)
        layout.addWidget(self.table, 1)

    def set_table(self, table: dict | None):
        """The report's "modules" entry of a device (None: the file records no modules)."""
        rows = (table or {}).get("rows") or []
        layers = (table or {}).get("layers") or []
        if not table:
            self.caption.setText("This file records no module per allocation (tracekit's recorder writes it).")
        else:
            self.caption.setText("; ".join(f"{g['pattern']} ({g['pass']}): {g['layers']} modules, "
                                           f"{fmt_bytes(g['bytes_at_peak_total'])} at the peak" for g in layers[:2]))
        self.caption.setVisible(bool(self.caption.text()))
        self.table.setToolTip("forward: made while the module's forward ran; backward: made by the backward "
                              "of its forward ops. At peak: live at the device's peak; most held: the most "
                              "it held at once.")
        self.table.setRowCount(len(rows))
        for r, row in enumerate(rows):
            cells = [row["module"], row["pass"], fmt_bytes(row["bytes_at_peak"]), fmt_bytes(row["peak_bytes"])]
            for c, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if c >= 2:
                    item.setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
                self.table.setItem(r, c, item)
