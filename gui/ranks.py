"""The rank dashboard: every rank's allocated memory as small multiples on one scale, the outlier
highlighted, the imbalance in words; click a rank to open its file. Built from the per-rank
summaries (tracekit.analysis.rank_pool.open_ranks), so hundreds of ranks need no file parsed."""
from __future__ import annotations

import os
import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Signal
from PySide6.QtWidgets import QGridLayout, QLabel, QScrollArea, QVBoxLayout, QWidget

from tracekit.render.ranks import imbalance_lines

from .palette import BLUE, VERMILLION, fmt_bytes

COLUMNS = 4
CELL_HEIGHT = 170


class RankPlot(pg.PlotWidget):
    clicked = Signal(str)

    def __init__(self, row, top, outlier, parent=None):
        super().__init__(parent, background="w")
        self.file = row["file"]
        colour = VERMILLION if outlier else BLUE
        when = (row.get("peak_when") or "").removeprefix("in the ")
        peak = ("needed ≥ " if row.get("demand_is_lower_bound") else "peak ") + fmt_bytes(row["peak_allocated_bytes"])
        self.setTitle(f"rank {row['rank']}: {peak}{' (out of memory)' if row.get('demand_is_lower_bound') else ''}"
                      f"{' (outlier)' if outlier else ''}", color=colour, size="9pt")
        self.setToolTip(f"{row['file']}\n{peak} {when}\n"
                        + "\n".join(f"{k}: {fmt_bytes(v)}" for k, v in row["categories_at_peak"].items())
                        + "\nclick to open the file")
        curve = row.get("curve") or {}
        y = np.asarray(curve.get("allocated") or [], np.float64) / 2**20
        x = np.asarray(curve.get("time_s") or curve.get("index") or [], np.float64)
        if len(x) == len(y) and len(y):
            self.plot(x, y, pen=pg.mkPen(colour, width=2 if outlier else 1), fillLevel=0,
                      brush=pg.mkBrush(colour + ("40" if outlier else "25")))
        self.setYRange(0, top, padding=0)
        self.getAxis("left").setLabel("MiB")
        self.getAxis("bottom").setLabel("s" if curve.get("time_s") else "entry")
        self.setMouseEnabled(False, False)
        self.setFixedHeight(CELL_HEIGHT)

    def mousePressEvent(self, event):
        self.clicked.emit(self.file)
        super().mousePressEvent(event)


class RankDashboard(QWidget):
    """Small multiples of a job's ranks. `table`: what tracekit.analysis.rank_pool.open_ranks(..., with_curves=True) returns."""

    open_file = Signal(str)

    def __init__(self, table, parent=None):
        super().__init__(parent)
        self.table = table
        layout = QVBoxLayout(self)
        rows = table["ranks"]
        imb = table.get("imbalance") or {}
        outlier = (imb.get("outlier") or {}).get("rank")
        text = [f"<b>{len(rows)} ranks</b> (ranks from {table['rank_source']}; {table['from_summaries']} from the "
                f"summaries beside the files, {table['analysed']} analysed)"] + imbalance_lines(imb)
        text += [f"not read: {e['error']}" for e in table.get("errors") or []]
        head = QLabel("<br>".join(text))
        head.setWordWrap(True)
        layout.addWidget(head)
        top = max([r["peak_allocated_bytes"] or 0 for r in rows] + [1]) / 2**20 * 1.05
        grid_box = QWidget()
        grid = QGridLayout(grid_box)
        self.plots = []
        for k, row in enumerate(rows):
            p = RankPlot(row, top, row["rank"] == outlier)
            p.clicked.connect(self.open_file.emit)
            grid.addWidget(p, k // COLUMNS, k % COLUMNS)
            self.plots.append(p)
        grid.setRowStretch(len(rows) // COLUMNS + 1, 1)  # the plots stay at the top
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(grid_box)
        layout.addWidget(scroll)


def start_ranks(window, folder):
    """A dashboard tab for a folder (or list) of rank files, read off the GUI thread."""
    from tracekit.analysis.rank_pool import open_ranks

    from .background import BackgroundTab

    def build(table):
        dash = RankDashboard(table)
        dash.open_file.connect(window.open_file)
        return dash

    name = os.path.basename(os.path.normpath(folder))
    return BackgroundTab(window, f"ranks: {name}", f"Reading the ranks in {folder}…",
                         lambda: open_ranks([folder], with_curves=True), build).start()
