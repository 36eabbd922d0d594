"""The allocations table: a Qt model over the replay's columnar arrays.

Sorting and filtering happen on numpy arrays (an index permutation), so a
table of 500k allocations sorts in milliseconds and Qt only ever asks for the
few rows on screen.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from PySide6.QtCore import QAbstractTableModel, QModelIndex, Qt
from PySide6.QtGui import QBrush, QColor

from tracekit.analysis.categories import METHODS
from tracekit.analysis.replay import BEFORE_TRACE

from .palette import category_color, fmt_bytes, fmt_duration_us

if TYPE_CHECKING:  # pandas only for the CSV export: imported then (~0.4 s off every start, before a load begins)
    import pandas as pd

COLUMNS = ("Size", "Category", "Allocated at", "Freed at", "Lifetime", "Where (your line)", "Library line", "Module",
           "Address")
SIZE, CATEGORY, ALLOCATED, FREED, LIFETIME, WHERE, LIBRARY, MODULE, ADDRESS = range(len(COLUMNS))
GROUPABLE = {WHERE: "your line", LIBRARY: "library line", MODULE: "module"}
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
        self.filter_group = None  # (column, id): only the allocations of one group (GroupsModel)

    # ---- data ------------------------------------------------------------------

    def set_document(self, doc, device):
        self.beginResetModel()
        self.doc, self.device = doc, device
        self.al = doc.replays[device].allocations
        n_entries = doc.replays[device].n
        self.labels, self.names, self.method = doc.labels(device)
        self.where_strings, self.where_ids = doc.where_table(device)
        self.lib_strings, self.lib_ids = doc.library_table(device)
        self.mod_strings, self.mod_ids = doc.module_table(device)
        self.filter_group = None
        xs, self.is_time = doc.xs(device)
        lo, hi = doc.x_range(device)
        self.x_alloc = np.where(self.al.alloc_index < 0, lo, xs[np.clip(self.al.alloc_index, 0, None)]
                                if len(xs) else lo)
        self.x_free = np.where(self.al.free_index < 0, hi, xs[np.clip(self.al.free_index, 0, None)]
                               if len(xs) else hi)
        self.free_key = np.where(self.al.free_index < 0, n_entries, self.al.free_index)
        self.lifetime = self.x_free - self.x_alloc
        self.where_rank = np.argsort(np.argsort(self.where_strings.astype(str), kind="stable"))
        self.lib_rank = np.argsort(np.argsort(self.lib_strings.astype(str), kind="stable"))
        self.mod_rank = np.argsort(np.argsort(self.mod_strings.astype(str), kind="stable"))
        self._apply(reset=False)
        self.endResetModel()

    def set_filter(self, text=None, category=None, live_at=None, group=False, **_):
        """Filter by text (category, your line, library line or module contains it), a category name, live at
        an entry, or `group` = (column, id): one group of GroupsModel (False: keep the current one)."""
        self.filter_text = (text or "").strip().lower() if text is not None else self.filter_text
        self.filter_category = category
        self.filter_live_at = live_at
        if group is not False:
            self.filter_group = group
        self._apply()

    def ids_of(self, column):
        """(strings, ids) of a groupable column."""
        return {WHERE: (self.where_strings, self.where_ids), LIBRARY: (self.lib_strings, self.lib_ids),
                MODULE: (self.mod_strings, self.mod_ids)}[column]

    def base_mask(self) -> np.ndarray:
        """The allocations the category, text and live filters keep (the group filter aside)."""
        return self._mask(with_group=False)

    def _mask(self, with_group=True) -> np.ndarray:
        mask = np.ones(len(self.al), bool)
        if self.filter_category is not None and self.filter_category in self.names:
            mask &= self.labels == self.names.index(self.filter_category)
        if self.filter_text:
            t = self.filter_text
            hit = lambda strings: np.array([t in s.lower() for s in strings], bool)  # noqa: E731
            cat_hit = np.array([t in n.lower() for n in self.names], bool)
            mask &= (hit(self.where_strings)[self.where_ids] | cat_hit[self.labels] | hit(self.lib_strings)[self.lib_ids]
                     | hit(self.mod_strings)[self.mod_ids])
        if self.filter_live_at is not None:
            mask &= self.al.live_at(self.filter_live_at)
        if with_group and self.filter_group is not None:
            column, gid = self.filter_group
            mask &= self.ids_of(column)[1] == gid
        return mask

    def _apply(self, reset=True):
        if self.doc is None:
            return
        mask = self._mask()
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
                LIFETIME: self.lifetime, WHERE: self.where_rank[self.where_ids], LIBRARY: self.lib_rank[self.lib_ids],
                MODULE: self.mod_rank[self.mod_ids], ADDRESS: self.al.addr}[self.sort_column]

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
        if col == LIBRARY:
            return self.lib_strings[self.lib_ids[row]]
        if col == MODULE:
            return self.mod_strings[self.mod_ids[row]]
        if col == ADDRESS:
            return f"0x{int(al.addr[row]):x}"
        return None

    def _tooltip(self, row, col):
        if col == CATEGORY:
            return f"{self.doc.reason(self.device, row)} (classified by {self.method_of(row)})"
        if col == SIZE:
            return f"{int(self.al.size[row]):,} bytes"
        if col == LIBRARY and self.lib_strings[self.lib_ids[row]]:
            return ("The innermost third-party frame of the model's code that made it (transformers, peft, ...), "
                    "'via' the helper it called; 'backward of' a line: memory autograd made for that forward line. "
                    f"Found from {self.doc.library_how(self.device, row)}.")
        if col == MODULE and self.mod_strings[self.mod_ids[row]]:
            return self.doc.module_how(self.device, row)
        if col == ALLOCATED and self.al.origin[row] == BEFORE_TRACE:
            return "allocated before recording began (the trace is a ring buffer or started late)"
        return None

    # ---- export ---------------------------------------------------------------------

    def to_frame(self) -> pd.DataFrame:
        """The rows in view, in view order, as plain columns (for CSV export)."""
        import pandas as pd

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
            "library_line": self.lib_strings[self.lib_ids[r]],
            "module": self.mod_strings[self.mod_ids[r]],
            "address": [f"0x{int(a):x}" for a in al.addr[r]],
        })


GROUP_COLUMNS = ("Size", "Count", "At peak", "Category", "")
G_SIZE, G_COUNT, G_PEAK, G_CATEGORY, G_KEY = range(len(GROUP_COLUMNS))


class GroupsModel(QAbstractTableModel):
    """The allocations of an AllocationsModel grouped by your line, library line or module: one row per group
    with its bytes (all its allocations, and those live at the device's peak), count and main category."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.column = WHERE
        self.keys = np.zeros(0, np.int64)
        self.order = np.zeros(0, np.int64)
        self.sort_column, self.sort_order = G_SIZE, Qt.DescendingOrder

    def set_groups(self, allocations: "AllocationsModel", column: int):
        """Group what `allocations` shows (its category, text and live filters) by `column`."""
        self.beginResetModel()
        self.source, self.column = allocations, column
        strings, ids = allocations.ids_of(column)
        self.strings = strings
        mask = allocations.base_mask()
        rows = np.flatnonzero(mask)
        al = allocations.al
        n = len(strings)
        sizes = al.size[rows].astype(np.float64)
        self.bytes = np.bincount(ids[rows], weights=sizes, minlength=n)
        self.count = np.bincount(ids[rows], minlength=n)
        rep = allocations.doc.replays[allocations.device]
        live = al.live_at(rep.peak_index)[rows]
        self.at_peak = np.bincount(ids[rows][live], weights=sizes[live], minlength=n)
        # main category of each group: as the report names a library line or site at the peak, the category with
        # the most bytes live at the peak (categories from the report's own function, categorize); a group with
        # nothing live then: the one with the most bytes over the trace
        labels = allocations.labels[rows].astype(np.int64)
        k = len(allocations.names)
        key = ids[rows].astype(np.int64) * k + labels
        per = np.bincount(key, weights=sizes, minlength=n * k).reshape(n, k)
        at_peak = np.bincount(key[live], weights=sizes[live], minlength=n * k).reshape(n, k)
        self.main = np.where(self.at_peak > 0, at_peak.argmax(axis=1), per.argmax(axis=1))
        # the largest allocation of each group (the inspector shows its stack)
        order = rows[np.lexsort((-al.size[rows], ids[rows]))]
        first = np.r_[True, ids[order][1:] != ids[order][:-1]] if len(order) else np.zeros(0, bool)
        self.lead = np.full(n, -1, np.int64)
        self.lead[ids[order][first]] = order[first]
        self.keys = np.flatnonzero(self.count > 0)
        self._sort()
        self.endResetModel()

    def _sort(self):
        key = {G_SIZE: self.bytes, G_COUNT: self.count, G_PEAK: self.at_peak, G_CATEGORY: self.main,
               G_KEY: np.argsort(np.argsort(self.strings.astype(str), kind="stable"))}[self.sort_column][self.keys]
        order = np.argsort(key, kind="stable")
        if self.sort_order == Qt.DescendingOrder:
            order = order[::-1]
        self.order = self.keys[order]

    def sort(self, column, order=Qt.AscendingOrder):
        self.layoutAboutToBeChanged.emit()
        self.sort_column, self.sort_order = column, order
        self._sort()
        self.layoutChanged.emit()

    def group_of(self, view_row) -> int:
        return int(self.order[view_row])

    def rowCount(self, parent=QModelIndex()):
        return 0 if parent.isValid() else len(self.order)

    def columnCount(self, parent=QModelIndex()):
        return 0 if parent.isValid() else len(GROUP_COLUMNS)

    def headerData(self, section, orientation, role=Qt.DisplayRole):
        if role == Qt.DisplayRole and orientation == Qt.Horizontal:
            return GROUP_COLUMNS[section] or COLUMNS[self.column]
        return None

    def data(self, index, role=Qt.DisplayRole):
        if not index.isValid():
            return None
        g, col = int(self.order[index.row()]), index.column()
        names = self.source.names
        if role == Qt.DisplayRole:
            if col == G_SIZE:
                return fmt_bytes(self.bytes[g])
            if col == G_COUNT:
                return f"{int(self.count[g]):,}"
            if col == G_PEAK:
                return fmt_bytes(self.at_peak[g]) if self.at_peak[g] else "—"
            if col == G_CATEGORY:
                return names[int(self.main[g])].replace("_", " ")
            return self.strings[g] or f"(no {GROUPABLE[self.column]})"
        if role == ROW_ROLE:
            return int(self.lead[g])
        if role == Qt.TextAlignmentRole and col in (G_SIZE, G_COUNT, G_PEAK):
            return int(Qt.AlignRight | Qt.AlignVCenter)
        if role == Qt.DecorationRole and col == G_CATEGORY:
            return QColor(category_color(names[int(self.main[g])], names))
        if role == Qt.ToolTipRole:
            return ("Size: all the group's allocations over the trace; at peak: those live at the device's peak. "
                    "Double-click to list its allocations.")
        return None
