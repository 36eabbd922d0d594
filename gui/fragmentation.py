"""The allocator window: reserved vs allocated over the trace as the caching allocator counts them, its
segments and blocks at the peak (or wherever you click), the largest free block, and a what-if on the
allocator's settings drawn over it.

All numbers come from tracekit.analysis.allocator (the same replay as `tracekit report` and the same model
as `tracekit whatif --alloc-conf`); this module only lays them out.
"""
from __future__ import annotations

import html

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import (QApplication, QHBoxLayout, QLabel, QLineEdit, QPushButton, QSplitter, QVBoxLayout,
                               QWidget)

from tracekit.analysis.allocator.view import fragmentation, whatif_curves
from tracekit.errors import TracekitError

from .palette import BLUE, GREY, ORANGE, RESERVED_COLOR, VERMILLION, byte_unit, fmt_bytes

STATE_COLORS = {"active_allocated": BLUE, "active_pending_free": GREY, "inactive": ORANGE}
MAX_ROWS = 80  # segments drawn at most (the largest); the caption says when more exist


class FragmentationPanel(QWidget):
    def __init__(self, doc, device, parent=None):
        super().__init__(parent)
        self.doc, self.device = doc, device
        self.setWindowTitle(f"tracekit · allocator · {doc.label(device)}")
        self.caption = QLabel()
        self.caption.setTextFormat(Qt.RichText)
        self.caption.setWordWrap(True)
        self.conf = QLineEdit("expandable_segments:True", placeholderText="PYTORCH_CUDA_ALLOC_CONF settings")
        self.conf.returnPressed.connect(self.run_whatif)
        run = QPushButton("What if")
        run.setToolTip("Replay these requests under these caching-allocator settings (tracekit whatif --alloc-conf)")
        run.clicked.connect(self.run_whatif)
        self.whatif_label = QLabel()
        self.whatif_label.setTextFormat(Qt.RichText)
        self.whatif_label.setWordWrap(True)
        bar = QHBoxLayout()
        bar.addWidget(QLabel("Settings:"))
        bar.addWidget(self.conf, 1)
        bar.addWidget(run)

        self.curves = pg.PlotWidget(background="w")
        self.curves.showGrid(x=False, y=True, alpha=0.2)
        self.curves.addLegend(offset=(10, 5))
        self.curves.setMouseEnabled(y=False)
        self.reserved_line = self.curves.plot(pen=pg.mkPen(RESERVED_COLOR, width=1.5, style=Qt.DashLine),
                                              name="reserved")
        self.allocated_line = self.curves.plot(pen=pg.mkPen(BLUE, width=1.5), name="allocated (blocks)")
        self.what_reserved = self.curves.plot(pen=pg.mkPen(VERMILLION, width=1.5, style=Qt.DashLine))
        self.what_allocated = self.curves.plot(pen=pg.mkPen(VERMILLION, width=1))
        self.cursor = pg.InfiniteLine(angle=90, pen=pg.mkPen("#222222", width=1))
        self.curves.addItem(self.cursor)
        self.curves.scene().sigMouseClicked.connect(self._clicked)

        self.segments = pg.PlotWidget(background="w")
        self.segments.setMouseEnabled(y=False)
        self.segments.getAxis("left").setStyle(showValues=False)
        self.segments.getPlotItem().hideButtons()
        self.segments_caption = QLabel()
        self.segments_caption.setWordWrap(True)
        lower = QWidget()
        ll = QVBoxLayout(lower)
        ll.setContentsMargins(0, 0, 0, 0)
        ll.addWidget(self.segments_caption)
        ll.addWidget(self.segments, 1)

        split = QSplitter(Qt.Vertical)
        split.addWidget(self.curves)
        split.addWidget(lower)
        split.setSizes([300, 380])
        layout = QVBoxLayout(self)
        layout.addWidget(self.caption)
        layout.addLayout(bar)
        layout.addWidget(self.whatif_label)
        layout.addWidget(split, 1)
        self.resize(1100, 780)
        self.view = None
        self.show_index(None)

    # ---- data ---------------------------------------------------------------------------------------

    def _xs(self, n):
        x, _ = self.doc.xs(self.device)
        return x if len(x) == n else np.arange(n, dtype=float)

    def show_index(self, index):
        """Segments after entry `index` (None: the allocated peak)."""
        QApplication.setOverrideCursor(Qt.WaitCursor)
        try:
            self.view = v = fragmentation(self.doc.trace, self.device, index)
        finally:
            QApplication.restoreOverrideCursor()
        if not v.modelled:
            self.caption.setText(f"<b>{html.escape(self.doc.label(self.device))}</b>: the caching allocator is not "
                                 f"modelled here ({html.escape(v.why or '')}).")
            return
        n = len(v.allocated)
        self.unit, self.scale = byte_unit(int(max(v.reserved.max(initial=0), v.initial_reserved)))
        x = self._xs(n)
        self.reserved_line.setData(x, v.reserved / self.scale, stepMode=None)
        self.allocated_line.setData(x, v.allocated / self.scale)
        self.curves.setLabel("left", self.unit)
        self.curves.setLabel("bottom", "seconds" if self.doc.has_time(self.device) else "trace entry")
        self.cursor.setValue(float(x[max(v.index, 0)]) if n else 0.0)
        exact = ("exact: every block where the allocator put it" if v.exact
                 else f"not exact: {html.escape(v.why or '')}")
        where = "the allocated peak" if v.index == v.peak_index else f"entry {v.index:,}"
        self.caption.setText(
            f"<b>{html.escape(self.doc.label(self.device))}</b> · settings: {html.escape(v.settings)} · {exact}<br>"
            f"At {where}: reserved <b>{fmt_bytes(v.reserved_at)}</b>, allocated <b>{fmt_bytes(v.allocated_at)}</b>, "
            f"unused <b>{fmt_bytes(v.unused_at)}</b> in {v.free_blocks} free blocks, the largest "
            f"<b>{fmt_bytes(v.largest_free)}</b>. Click the curves to see another moment.")
        self._draw_segments(v)

    def _draw_segments(self, v):
        self.segments.clear()
        segs = sorted(v.segments, key=lambda s: -s["total_size"])
        shown = segs[:MAX_ROWS]
        x0, widths, ys, brushes = [], [], [], []
        for row, s in enumerate(shown):
            for b in s["blocks"]:
                x0.append((b["address"] - s["address"]) / 2**20)
                widths.append(b["size"] / 2**20)
                ys.append(row)
                brushes.append(pg.mkBrush(STATE_COLORS.get(b["state"], GREY)))
        if x0:
            self.segments.addItem(pg.BarGraphItem(x0=x0, width=widths, y=ys, height=0.8, brushes=brushes,
                                                  pen=pg.mkPen("w", width=0.5)))
        self.segments.setLabel("bottom", "MiB into the segment")
        self.segments.getViewBox().invertY(True)
        more = f" (the {MAX_ROWS} largest of {len(segs)})" if len(segs) > MAX_ROWS else ""
        self.segments_caption.setText(
            f"Segments at {'the peak' if v.index == v.peak_index else f'entry {v.index:,}'}, largest first{more}: "
            "blue allocated, orange free (cached), grey freed but waiting for another stream.")

    def _clicked(self, event):
        if self.view is None or not self.view.modelled:
            return
        pos = self.curves.getViewBox().mapSceneToView(event.scenePos())
        x = self._xs(len(self.view.allocated))
        if len(x):
            self.show_index(int(np.clip(np.searchsorted(x, pos.x()), 0, len(x) - 1)))

    # ---- what-if -------------------------------------------------------------------------------------

    def run_whatif(self):
        if self.view is None or not self.view.modelled:
            return
        QApplication.setOverrideCursor(Qt.WaitCursor)
        try:
            w = whatif_curves(self.doc.trace, self.device, self.conf.text())
        except TracekitError as e:
            self.whatif_label.setText(f"<span style='color:{VERMILLION}'>{html.escape(str(e))}</span>")
            return
        finally:
            QApplication.restoreOverrideCursor()
        x = self._xs(len(w["whatif"]["reserved"]))
        self.what_reserved.setData(x, w["whatif"]["reserved"] / self.scale)
        self.what_allocated.setData(x, w["whatif"]["allocated"] / self.scale)
        b, a = w["baseline"], w["whatif"]
        saved = b["peak_reserved"] - a["peak_reserved"]
        verdict = (f"saves {fmt_bytes(saved)}" if saved > 0 else f"costs {fmt_bytes(-saved)} more" if saved < 0
                   else "changes nothing")
        failed = f"; {a['failed_requests']} requests would fail" if a["failed_requests"] else ""
        self.whatif_label.setText(
            f"<span style='color:{VERMILLION}'>What if {html.escape(w['settings'])}</span> (red): peak reserved "
            f"<b>{fmt_bytes(a['peak_reserved'])}</b> against {fmt_bytes(b['peak_reserved'])} for the model under the "
            f"recorded settings ({verdict}); unused at its peak {fmt_bytes(a['unused_at_peak'])}, largest free block "
            f"{fmt_bytes(a['largest_free_at_peak'])}{failed}.")


def show(doc, device, parent=None) -> FragmentationPanel:
    """Open the allocator window for a document's device, as its own window."""
    panel = FragmentationPanel(doc, device)
    panel.setParent(parent, Qt.Window)
    panel.show()
    return panel
