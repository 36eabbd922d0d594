"""The allocations table: a Qt model over the replay's columnar arrays.

Sorting and filtering happen on numpy arrays (an index permutation), so a
table of 500k allocations sorts in milliseconds and Qt only ever asks for the
few rows on screen.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
from PySide6.QtCore import QAbstractTableModel, QModelIndex, Qt
from PySide6.QtGui import QBrush, QColor

from tracekit.analysis.categories import METHODS
from tracekit.analysis.replay import BEFORE_TRACE

from .palette import category_color, fmt_bytes, fmt_duration_us

COLUMNS = ("Size", "Category", "Allocated at", "Freed at", "Lifetime", "Where (your line)", "Address")
SIZE, CATEGORY, ALLOCATED, FREED, LIFETIME, WHERE, ADDRESS = range(len(COLUMNS))
ROW_ROLE = Qt.UserRole + 1  # the allocation's row in replay(trace)[device].allocations


class AllocationsModel(QAbstractTableModel):
    """Rows are allocation lifetimes of one device; `order` maps view rows to allocation rows."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.doc = None
        self.device = None
        self.order = np.zeros(0, np.int64)
        self.sort_column, self.sort_order = SIZE, Qt.DescendingOrder
        self.filter_text, self.filter_category, self.filter_live_at = "", None, None

    # ---- data ------------------------------------------------------------------

    def set_document(self, doc, device):
        self.beginResetModel()
        self.doc, self.device = doc, device
        self.al = doc.replays[device].allocations
        n_entries = doc.replays[device].n
        self.labels, self.names, self.method = doc.labels(device)
        self.where_strings, self.where_ids = doc.where_table(device)
        xs, self.is_time = doc.xs(device)
        lo, hi = doc.x_range(device)
        self.x_alloc = np.where(self.al.alloc_index < 0, lo, xs[np.clip(self.al.alloc_index, 0, None)]
                                if len(xs) else lo)
        self.x_free = np.where(self.al.free_index < 0, hi, xs[np.clip(self.al.free_index, 0, None)]
                               if len(xs) else hi)
        self.free_key = np.where(self.al.free_index < 0, n_entries, self.al.free_index)
        self.lifetime = self.x_free - self.x_alloc
        self.where_rank = np.argsort(np.argsort(self.where_strings.astype(str), kind="stable"))
        self._apply(reset=False)
        self.endResetModel()

    def set_filter(self, text=None, category=None, live_at=None, **_):
        """Filter by text (category or top frame contains it), a category name, or live at an entry."""
        self.filter_text = (text or "").strip().lower() if text is not None else self.filter_text
        self.filter_category = category
        self.filter_live_at = live_at
        self._apply()

    def _apply(self, reset=True):
        if self.doc is None:
            return
        mask = np.ones(len(self.al), bool)
        if self.filter_category is not None and self.filter_category in self.names:
            mask &= self.labels == self.names.index(self.filter_category)
        if self.filter_text:
            t = self.filter_text
            where_hit = np.array([t in s.lower() for s in self.where_strings], bool)
            cat_hit = np.array([t in n.lower() for n in self.names], bool)
            mask &= where_hit[self.where_ids] | cat_hit[self.labels]
        if self.filter_live_at is not None:
            mask &= self.al.live_at(self.filter_live_at)
        rows = np.flatnonzero(mask)
        if self.sort_column == SIZE and len(rows) == len(mask):  # the default view: kept by the document
            order = self.doc.table_order(self.device, "size", self.al.size)
        else:
            order = np.argsort(self._sort_key()[rows], kind="stable")
        if self.sort_order == Qt.DescendingOrder:
            order = order[::-1]
        if reset:
            self.beginResetModel()
        self.order = rows[order]
        if reset:
            self.endResetModel()

    def _sort_key(self):
        return {SIZE: self.al.size, CATEGORY: self.labels, ALLOCATED: self.al.alloc_index, FREED: self.free_key,
                LIFETIME: self.lifetime, WHERE: self.where_rank[self.where_ids], ADDRESS: self.al.addr}[self.sort_column]

    def sort(self, column, order=Qt.AscendingOrder):
        self.layoutAboutToBeChanged.emit()
        self.sort_column, self.sort_order = column, order
        self._apply(reset=False)
        self.layoutChanged.emit()

    def row_of(self, view_row) -> int:
        return int(self.order[view_row])

    def view_row_of(self, allocation_row) -> int:
        hit = np.flatnonzero(self.order == allocation_row)
        return int(hit[0]) if len(hit) else -1

    def category_of(self, row) -> str:
        return self.names[self.labels[row]]

    def method_of(self, row) -> str | None:
        return METHODS[int(self.method[row])]

    # ---- Qt model ------------------------------------------------------------------

    def rowCount(self, parent=QModelIndex()):
        return 0 if parent.isValid() else len(self.order)

    def columnCount(self, parent=QModelIndex()):
        return 0 if parent.isValid() else len(COLUMNS)

    def headerData(self, section, orientation, role=Qt.DisplayRole):
        if role == Qt.DisplayRole and orientation == Qt.Horizontal:
            return COLUMNS[section]
        return None

    def data(self, index, role=Qt.DisplayRole):
        if not index.isValid():
            return None
        row, col = int(self.order[index.row()]), index.column()
        if role == Qt.DisplayRole:
            return self._text(row, col)
        if role == ROW_ROLE:
            return row
        if role == Qt.TextAlignmentRole and col in (SIZE, LIFETIME, ALLOCATED, FREED):
            return int(Qt.AlignRight | Qt.AlignVCenter)
        if role == Qt.DecorationRole and col == CATEGORY:
            return QColor(category_color(self.category_of(row), self.names))
        if role == Qt.ToolTipRole:
            return self._tooltip(row, col)
        if role == Qt.ForegroundRole and col == FREED and self.al.free_index[row] < 0:
            return QBrush(QColor("#B00000"))
        return None

    def _entry_text(self, index, x, missing):
        if index < 0:
            return missing
        return f"{index:,}  ({x:.4f} s)" if self.is_time else f"{index:,}"

    def _text(self, row, col):
        al = self.al
        if col == SIZE:
            return fmt_bytes(al.size[row])
        if col == CATEGORY:
            return self.category_of(row).replace("_", " ")
        if col == ALLOCATED:
            return self._entry_text(int(al.alloc_index[row]), self.x_alloc[row], "before trace")
        if col == FREED:
            return self._entry_text(int(al.free_index[row]), self.x_free[row], "live at end")
        if col == LIFETIME:
            prefix = "≥ " if al.alloc_index[row] < 0 or al.free_index[row] < 0 else ""
            if self.is_time:
                return prefix + fmt_duration_us(self.lifetime[row] * 1e6)
            return f"{prefix}{int(self.lifetime[row]):,} entries"
        if col == WHERE:
            return self.where_strings[self.where_ids[row]]
        if col == ADDRESS:
            return f"0x{int(al.addr[row]):x}"
        return None

    def _tooltip(self, row, col):
        if col == CATEGORY:
            return f"{self.doc.reason(self.device, row)} (classified by {self.method_of(row)})"
        if col == SIZE:
            return f"{int(self.al.size[row]):,} bytes"
        if col == ALLOCATED and self.al.origin[row] == BEFORE_TRACE:
            return "allocated before recording began (the trace is a ring buffer or started late)"
        return None

    # ---- export ---------------------------------------------------------------------

    def to_frame(self) -> pd.DataFrame:
        """The rows in view, in view order, as plain columns (for CSV export)."""
        r = self.order
        al = self.al
        return pd.DataFrame({
            "size_bytes": al.size[r],
            "category": np.array(self.names, dtype=object)[self.labels[r]],
            "method": np.array(METHODS, dtype=object)[self.method[r]],
            "alloc_entry": al.alloc_index[r],
            "free_entry": al.free_index[r],
            ("alloc_time_s" if self.is_time else "alloc_x"): self.x_alloc[r],
            ("free_time_s" if self.is_time else "free_x"): self.x_free[r],
            "origin": np.where(al.origin[r] == BEFORE_TRACE, "before_trace", "traced"),
            "where": self.where_strings[self.where_ids[r]],
            "address": [f"0x{int(a):x}" for a in al.addr[r]],
        })
