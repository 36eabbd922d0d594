"""Modules panel: bytes per nn.Module and pass at the peak, and the most each held (analysis/modules.py).

For a file made by tracekit's recorder the modules are the recorded ones; for any other file they are
found from the stacks (analysis/modtree.py) and each row also shows its class chain
(`Qwen2ForCausalLM > Qwen2Model > Qwen2DecoderLayer[2] > Qwen2Attention`) and how it was found.
"""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QHeaderView, QLabel, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget

from .palette import fmt_bytes


class ModulesPanel(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.caption = QLabel()
        self.caption.setWordWrap(True)
        self.caption.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.table = QTableWidget(0, 5)
        self.table.setHorizontalHeaderLabels(["Module", "Pass", "At peak", "Most held", "Classes"])
        self.table.verticalHeader().hide()
        self.table.verticalHeader().setDefaultSectionSize(21)
        self.table.setEditTriggers(QTableWidget.NoEditTriggers)
        self.table.setSelectionMode(QTableWidget.NoSelection)
        self.table.setAlternatingRowColors(True)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.Interactive)
        for c in (1, 2, 3):
            header.setSectionResizeMode(c, QHeaderView.ResizeToContents)
        header.setStretchLastSection(True)
        self.table.setColumnWidth(0, 320)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.caption)
        layout.addWidget(self.table, 1)

    def set_table(self, table: dict | None):
        """The report's "modules" entry of a device (None: no module is known for any allocation)."""
        rows = (table or {}).get("rows") or []
        layers = (table or {}).get("layers") or []
        if not table:
            self.caption.setText("There is no module for this file's allocations: tracekit's recorder writes them, "
                                 "and for other files they are found from the stacks' forward frames, which this "
                                 "file does not have.")
        else:
            parts = []
            if table.get("source") == "stacks":
                parts.append("Found from the stacks (the chain of forward calls, named from the library's source; "
                             "hover a row for how).")
            parts += [f"{g['pattern']} ({g['pass']}): {g['layers']} modules, {fmt_bytes(g['bytes_at_peak_total'])} at "
                      f"the peak" + (f" — {g['classes']}" if g.get("classes") else "") for g in layers[:3]]
            self.caption.setText("\n".join(parts))
        self.caption.setVisible(bool(self.caption.text()))
        self.table.setToolTip("forward: made while the module's forward ran; backward: made by the backward "
                              "of its forward ops. At peak: live at the device's peak; most held: the most "
                              "it held at once.")
        self.table.setRowCount(len(rows))
        for r, row in enumerate(rows):
            cells = [row["module"], row["pass"], fmt_bytes(row["bytes_at_peak"]), fmt_bytes(row["peak_bytes"]),
                     row.get("classes") or ""]
            for c, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if 2 <= c <= 3:
                    item.setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
                if row.get("how"):
                    item.setToolTip(f"found {row['how']}")
                self.table.setItem(r, c, item)
