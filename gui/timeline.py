"""The timeline: memory over time stacked by category, reserved memory, phases and findings.

Only what can be seen is drawn: after every pan or zoom the visible entry range
is re-queried from the analysis (`Document.series`) with about one point per
pixel, so a million-entry trace costs the same to draw as a small one.
"""
from __future__ import annotations

import html

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt, QTimer, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QHBoxLayout, QLabel, QSizePolicy, QVBoxLayout, QWidget

from .palette import (FINDING_COLORS, HIGHLIGHT_COLOR, LOW_COLOR, RESERVED_COLOR, RESERVED_FILL, byte_unit,
                      category_color, fmt_bytes, phase_color)
from .snapshot import SnapshotBars

REFRESH_MS = 25  # debounce between a view change and the re-query
MAX_PHASE_LABELS = 40
MAX_GENERATION_LABELS = 2000  # a generation's steps: labelled when zoomed in enough to read them
MAX_ITERATION_LABELS = 30
MIN_ITERATION_SPACING_PX = 6  # fewer pixels between iteration lines on average: none drawn
LABEL_LIFT = 1.6  # a marker's caption sits this many caption heights above it
MARKER_SYMBOLS = {"peak": "t", "spike": "t", "leak": "d", "oom": "x", "fragmentation": "s"}


def _nice_ceil(v: float) -> float:
    """The next of 1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8 (x 10^k) at or above v: the y range changes only in steps."""
    k = 10.0 ** np.floor(np.log10(v))
    return k * next(m for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10) if m * k >= v * (1 - 1e-9))


def _color(hex_color, alpha=255) -> QColor:
    c = QColor(hex_color)
    c.setAlpha(alpha)
    return c


class Legend(QWidget):
    """Colour swatches above the plot (part of the exported PNG). One word-wrapped label: entries that do not fit
    the width go on to a second line, whole, instead of being cut at the right edge ("paramete", "temporar")."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.row = QHBoxLayout(self)
        self.row.setContentsMargins(8, 2, 8, 2)
        self.label = QLabel()
        self.label.setTextFormat(Qt.RichText)
        self.label.setWordWrap(True)
        self.row.addWidget(self.label, 1)
        # never widen the window for the legend: it wraps instead
        self.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        self.texts: list[str] = []

    def set_entries(self, entries):
        """entries: [(text, colour, style)] with style "fill", "line", "band" or "caption"."""
        parts, self.texts = [], []
        for text, colour, style in entries:
            shown = html.escape(text.strip()).replace(" ", "&nbsp;")  # an entry never breaks inside
            self.texts.append(text.strip())
            if style == "caption":
                parts.append(f'<span style="color:#555555">{shown}</span>')
                continue
            swatch = {"fill": "■", "line": "┅", "band": "■"}[style]
            parts.append(f'<span style="color:{colour}; font-size:15px">{swatch}</span>&nbsp;{shown}')
        self.label.setText("&nbsp;&nbsp; ".join(parts))  # the plain space after each entry is where lines break


class PhaseBands(pg.GraphicsObject):
    """The phase lane's bands, one item for all of them. A long run has thousands of spans: only those in
    view are painted, and where more of them than pixels are in view, one band per pixel column (the span
    under its centre), runs of one colour merged, so a frame costs the same at any length."""

    Y0, HEIGHT = 0.1, 0.8

    def __init__(self, x0, x1, colors):
        super().__init__()
        order = np.argsort(x0, kind="stable")
        self.x0, self.x1 = np.asarray(x0, float)[order], np.asarray(x1, float)[order]
        self._reach = np.maximum.accumulate(self.x1) if len(self.x1) else self.x1  # sorted: the first in view
        names = list(dict.fromkeys(colors))
        self.colors = [QColor(c) for c in names]
        self.code = np.array([names.index(c) for c in colors], np.int32)[order] if len(colors) else np.zeros(0, np.int32)
        lo = float(self.x0.min()) if len(self.x0) else 0.0
        hi = float(self.x1.max()) if len(self.x1) else 0.0
        self._rect = QRectF(lo, self.Y0, hi - lo, self.HEIGHT)

    def boundingRect(self):
        return self._rect

    def runs(self, v0: float, v1: float, pixels: int):
        """(x0, x1, colour code) of the bands to paint over [v0, v1] at `pixels` columns."""
        x0, x1, code = self.x0, self.x1, self.code
        i0 = int(np.searchsorted(self._reach, v0, "left"))
        i1 = int(np.searchsorted(x0, v1, "right"))
        if i1 - i0 <= 2 * pixels:
            return x0[i0:i1], x1[i0:i1], code[i0:i1]
        step = (v1 - v0) / pixels
        centre = v0 + (np.arange(pixels) + 0.5) * step
        j = np.searchsorted(x0, centre, "right") - 1
        inside = (j >= 0) & (centre < x1[np.maximum(j, 0)])
        c = np.where(inside, code[np.maximum(j, 0)], -1)
        edge = np.flatnonzero(np.diff(c)) + 1
        first = np.concatenate(([0], edge))
        last = np.concatenate((edge, [pixels]))
        keep = c[first] >= 0
        return v0 + first[keep] * step, v0 + last[keep] * step, c[first][keep]

    def paint(self, painter, *args):
        vb = self.getViewBox()
        if vb is None or not len(self.x0):
            return
        (v0, v1), _ = vb.viewRange()
        pixels = max(int(vb.width()), 1)
        painter.setPen(Qt.NoPen)
        a, b, k = self.runs(v0, v1, pixels)
        for code in np.unique(k).tolist():  # one call per colour
            mine = k == code
            painter.setBrush(self.colors[code])
            painter.drawRects([QRectF(x, self.Y0, w, self.HEIGHT)
                               for x, w in zip(a[mine].tolist(), (b[mine] - a[mine]).tolist())])


class TimelineWidget(QWidget):
    """Stacked category timeline of one device of a Document."""

    hovered = Signal(int)  # trace entry under the mouse (-1 before the first)
    clicked = Signal(int)  # trace entry clicked
    finding_clicked = Signal(int)  # position in Document.findings(device)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.doc = None
        self.device = None
        self.names: list[str] = []
        self.present_names: list[str] = []  # categories with bytes somewhere in the trace
        self.scale, self.unit = 1.0, "bytes"
        self._fills: dict[str, pg.PlotDataItem] = {}
        self._decor: list = []  # per-document items: phases, iterations, markers
        self._highlight = []
        self._phase_labels = []
        self._iteration_labels = []
        self._marker_labels = []  # (TextItem, x, y in plot units): peak and OOM captions kept inside the plot
        self._iteration_x = np.zeros(0)
        self._legend_entries: list = []
        self._low_shown = False  # the low line (and its legend entry) is drawn
        self._fetched = None  # (start, end, max_points, view width) of the drawn query
        self._shown_index = self._shown_top = np.zeros(0)
        self._timer = QTimer(self, singleShot=True, interval=REFRESH_MS, timeout=self.refresh)
        self.last_query = None  # (fetched start, fetched end, view width px, points drawn): tests, benchmark

        self.legend = Legend(self)
        self.graphics = pg.GraphicsLayoutWidget(self)
        self.graphics.setBackground("w")
        self.graphics.ci.setContentsMargins(4, 4, 12, 4)
        self.graphics.ci.setSpacing(0)

        self.lane = self.graphics.addPlot(row=0, col=0)
        self.lane.setMaximumHeight(26)
        self.lane.hideAxis("bottom")
        self.lane.getAxis("left").setWidth(70)
        self.lane.getAxis("left").setTicks([[]])
        self.lane.getAxis("left").setPen(pg.mkPen(None))
        self.lane.getAxis("left").setLabel("phases", **{"font-size": "8pt"})
        self.lane.setMouseEnabled(x=False, y=False)
        self.lane.setYRange(0, 1, padding=0)
        self.lane.hideButtons()
        self.lane.setMenuEnabled(False)

        self.plot = self.graphics.addPlot(row=1, col=0)
        self.plot.getAxis("left").setWidth(70)
        self.plot.getAxis("left").enableAutoSIPrefix(False)
        self.plot.hideButtons()
        self.plot.showGrid(x=False, y=True, alpha=0.25)
        self.plot.setMouseEnabled(x=True, y=False)
        self.lane.setXLink(self.plot)
        self.vb = self.plot.getViewBox()
        self.vb.sigXRangeChanged.connect(lambda *_: self._timer.start())
        self.vb.sigResized.connect(lambda *_: self._timer.start())

        self.total_line = self.plot.plot(pen=pg.mkPen("#222222", width=1))
        self.total_line.setZValue(50)
        # zoomed out past one entry per pixel: the fills and the total follow each bucket's highest entry, and
        # this line its lowest (the trough between peaks), so the curve never folds into a solid block
        self.low_line = self.plot.plot(pen=pg.mkPen(LOW_COLOR, width=1))
        self.low_line.setZValue(49)
        self.reserved_line = self.plot.plot(pen=pg.mkPen(RESERVED_COLOR, width=1.5, style=Qt.DashLine),
                                            fillLevel=0, brush=pg.mkBrush(RESERVED_FILL))
        self.reserved_line.setZValue(-10)  # its fill lies under the categories; the dashes show above them
        self.reserved_edge = self.plot.plot(pen=pg.mkPen(RESERVED_COLOR, width=1.5, style=Qt.DashLine))
        self.reserved_edge.setZValue(51)
        self.iteration_lines = pg.PlotDataItem(connect="pairs", pen=pg.mkPen("#777777", width=1, style=Qt.DotLine))
        self.iteration_lines.setZValue(40)
        self.plot.addItem(self.iteration_lines, ignoreBounds=True)
        self.hover_line = pg.InfiniteLine(angle=90, pen=pg.mkPen("#888888", width=1))
        self.hover_line.setZValue(60)
        self.hover_line.hide()
        self.cursor_line = pg.InfiniteLine(angle=90, pen=pg.mkPen(HIGHLIGHT_COLOR, width=1.5))
        self.cursor_line.setZValue(61)
        self.cursor_line.hide()
        self.plot.addItem(self.hover_line, ignoreBounds=True)
        self.plot.addItem(self.cursor_line, ignoreBounds=True)
        # a generation's KV cache over time, on an axis of its own under the plot (it is small beside the weights)
        self.kv = self.graphics.addPlot(row=2, col=0)
        self.kv.setMaximumHeight(90)
        self.kv.getAxis("left").setWidth(70)
        self.kv.getAxis("left").enableAutoSIPrefix(False)
        self.kv.hideAxis("bottom")
        self.kv.setMouseEnabled(x=False, y=False)
        self.kv.hideButtons()
        self.kv.setMenuEnabled(False)
        self.kv.showGrid(x=False, y=True, alpha=0.25)
        self.kv.setXLink(self.plot)
        self.kv_line = self.kv.plot(pen=pg.mkPen(category_color("kv_cache"), width=2), fillLevel=0,
                                    brush=pg.mkBrush(_color(category_color("kv_cache"), 110)))
        self.kv.setVisible(False)
        self.markers = pg.ScatterPlotItem(size=13, hoverable=True, tip=self._marker_tip)
        self.markers.setZValue(70)
        self.markers.sigClicked.connect(self._marker_clicked)
        self.plot.addItem(self.markers)

        self._mouse = pg.SignalProxy(self.plot.scene().sigMouseMoved, rateLimit=30, slot=self._mouse_moved)
        self.plot.scene().sigMouseClicked.connect(self._mouse_clicked)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        self.bars = SnapshotBars(self)  # shown instead of the plot for a file without a timeline
        self.bars.hide()
        self.snapshot_only = False
        layout.addWidget(self.legend)
        layout.addWidget(self.graphics, 1)
        layout.addWidget(self.bars, 1)

    # ---- content ---------------------------------------------------------------

    def set_document(self, doc, device):
        """Show `device` of `doc`; resets the view to the whole trace."""
        self.doc, self.device = doc, device
        for item in self._fills.values():
            self.plot.removeItem(item)
        for owner, item in self._decor:
            owner.removeItem(item)
        self._fills.clear()
        self._decor.clear()
        self._iteration_labels.clear()
        self._marker_labels.clear()
        self.clear_highlight()
        self.cursor_line.hide()
        self._fetched = None
        rep = doc.replays[device]
        top = max(rep.peak_allocated or 0, rep.peak_reserved or 0)
        self.unit, self.scale = byte_unit(top)
        self.names = doc.category_names(device)
        is_time = doc.has_time(device)
        self.plot.setLabel("left", f"memory ({self.unit})")
        if is_time:
            self.plot.setLabel("bottom", "time since the first entry", units="s")
        else:
            self.plot.setLabel("bottom", "trace entry")
        self.plot.getAxis("bottom").enableAutoSIPrefix(is_time)

        full = doc.series(device, max_points=2000)
        present = [n for n in self.names if len(full.by_category.get(n, [])) and np.any(full.by_category[n])]
        self.snapshot_only = not doc.has_timeline(device)
        if self.snapshot_only:
            sites = doc.live_by_site(device)
            present = [n for n in self.names if any(r["category"] == n for r in sites)]
            self.bars.set_rows(sites, self.names, self.unit, self.scale, rep.n)
        self.present_names = present or list(self.names)
        for z, name in enumerate(self.names):
            item = pg.PlotDataItem(pen=None, fillLevel=0, brush=pg.mkBrush(category_color(name, self.names)))
            item.setZValue(len(self.names) - z)  # lower categories paint over the higher cumulative fills
            self.plot.addItem(item)
            self._fills[name] = item
        entries = [(n.replace("_", " "), category_color(n, self.names), "fill") for n in present or self.names]
        if full.reserved is not None and not self.snapshot_only:
            entries.append(("reserved", RESERVED_COLOR, "line"))
            entries.append(("unused reserved", "#D0D0D0", "fill"))
        self._add_phases(entries)
        self._add_kv(entries)
        self._add_markers()
        self._legend_entries, self._low_shown = entries, False
        self.legend.set_entries(entries)
        self.graphics.setVisible(not self.snapshot_only)
        self.bars.setVisible(self.snapshot_only)

        lo, hi = doc.x_range(device)
        pad = (hi - lo) * 0.01
        self.vb.setLimits(xMin=lo - pad, xMax=hi + pad)
        self.reset_zoom()
        self.refresh()

    def _add_phases(self, legend_entries):
        spans = self.doc.phase_spans(self.device)
        seen = list(dict.fromkeys("decode" if phase.startswith("step ") else phase for phase, *_ in spans))
        if spans:
            x0 = np.array([s[2] for s in spans], dtype=float)
            x1 = np.maximum(np.array([s[3] for s in spans], dtype=float), x0)
            bars = PhaseBands(x0, x1, [phase_color(s[0]) for s in spans])
            self.lane.addItem(bars)
            self._decor.append((self.lane, bars))
        self._phase_labels = []
        generation = any(phase.startswith("step ") for phase, *_ in spans)
        if len(spans) <= (MAX_GENERATION_LABELS if generation else MAX_PHASE_LABELS):  # shown where wide enough
            for phase, iteration, x0, x1 in spans:
                text = pg.TextItem(phase, color="#222222", anchor=(0, 0.5))
                text.setPos(x0, 0.5)
                self.lane.addItem(text)
                self._decor.append((self.lane, text))
                self._phase_labels.append((text, x1 - x0, 7 * len(phase) + 8))
        if seen:
            legend_entries.append(("  phases:", "", "caption"))
        for phase in seen:
            legend_entries.append(("decode steps" if phase == "decode" else phase, phase_color(phase), "band"))
        starts = self.doc.iteration_starts(self.device)
        # All iteration boundaries as one item of vertical segments (cheap with hundreds of them).
        self._iteration_x = np.repeat(np.array([x for _, x in starts], dtype=float), 2)
        self.iteration_lines.setData(self._iteration_x, np.zeros(len(self._iteration_x)))
        if len(starts) <= MAX_ITERATION_LABELS:
            for iteration, x in starts:
                label = pg.TextItem(f"iter {iteration}", color="#555555", anchor=(0, 0))
                label.setPos(x, 0)
                label.setZValue(40)
                self.plot.addItem(label, ignoreBounds=True)
                self._decor.append((self.plot, label))
                self._iteration_labels.append(label)
        warm = self.doc.warmup(self.device)
        if warm is not None:  # the compile warm-up: marked, and left out of the opening view (reset_zoom)
            x0, x1 = self.doc.x_of(self.device, warm["first_index"]), self.doc.x_of(self.device, warm["last_index"] + 1)
            band = pg.LinearRegionItem(values=(x0, x1), movable=False, brush=pg.mkBrush(200, 200, 200, 60),
                                       pen=pg.mkPen(None))
            self.plot.addItem(band, ignoreBounds=True)
            self._decor.append((self.plot, band))
            label = pg.TextItem("compile warm-up", color="#555555", anchor=(1, 0))
            label.setPos(x1, 0)
            self.plot.addItem(label, ignoreBounds=True)
            self._decor.append((self.plot, label))
            legend_entries.append(("compile warm-up", "#C8C8C8", "band"))
        self.lane.setVisible(bool(spans))

    def _add_kv(self, legend_entries):
        """The KV-cache lane of a generation: its bytes over time, growing step by step."""
        got = None if self.snapshot_only else self.doc.kv_series(self.device)
        if got is None or not len(got[1]) or not np.any(got[1]):
            self.kv.setVisible(False)
            self.plot.showAxis("bottom")
            return
        # the time axis moves under the lane
        bottom = self.plot.getAxis("bottom")
        self.kv.showAxis("bottom")
        self.kv.setLabel("bottom", bottom.labelText, units=bottom.labelUnits)
        self.kv.getAxis("bottom").enableAutoSIPrefix(self.doc.has_time(self.device))
        self.kv.setMaximumHeight(120)
        self.plot.hideAxis("bottom")
        x, y = got
        unit, scale = byte_unit(int(y.max()))
        xs = np.repeat(x, 2)[1:]
        ys = np.repeat(y / scale, 2)[:-1]
        self.kv_line.setData(xs, ys)
        self.kv.setLabel("left", f"KV cache ({unit})", **{"font-size": "8pt"})
        self.kv.setYRange(0, float(y.max() / scale) * 1.15, padding=0)
        self.kv.setVisible(True)
        legend_entries.append(("KV cache (lane below)", category_color("kv_cache"), "line"))

    def _add_markers(self):
        """Findings that point at a trace entry become clickable markers on the curve."""
        rep = self.doc.replays[self.device]
        spots = []
        for i, f in enumerate(self.doc.findings(self.device)):
            index = f.get("index")
            if index is None or f.get("kind") in ("advice", "fragmentation"):
                continue
            kind = f.get("kind", "")
            colour = FINDING_COLORS.get(kind, "#000000")
            y = rep.allocated_at(index) / self.scale
            spots.append({"pos": (self.doc.x_of(self.device, index), y), "data": i,
                          "symbol": MARKER_SYMBOLS.get(kind, "o"), "brush": pg.mkBrush(colour),
                          "pen": pg.mkPen("w", width=1)})
            if kind in ("peak", "oom"):
                label = pg.TextItem(f"{kind} {fmt_bytes(f.get('bytes'))}" if kind == "peak" else "OOM",
                                    color=colour, anchor=(0.5, LABEL_LIFT), fill=pg.mkBrush(255, 255, 255, 200))
                label.setPos(*spots[-1]["pos"])
                label.setZValue(71)
                self.plot.addItem(label, ignoreBounds=True)
                self._decor.append((self.plot, label))
                self._marker_labels.append((label, *spots[-1]["pos"]))
            if kind == "oom":
                line = pg.InfiniteLine(spots[-1]["pos"][0], angle=90, pen=pg.mkPen(colour, width=2))
                self.plot.addItem(line, ignoreBounds=True)
                self._decor.append((self.plot, line))
        self.markers.setData(spots)

    def _marker_tip(self, x, y, data):
        f = self.doc.findings(self.device)[data]
        return f"{f.get('kind', '').upper()}: {f.get('summary', '')}"

    def _marker_clicked(self, item, points, *args):
        if len(points):
            self.finding_clicked.emit(int(points[0].data()))

    # ---- drawing ---------------------------------------------------------------

    def visible_entries(self) -> tuple[int, int]:
        """[start, end) of the trace entries in view, one either side to draw the edges."""
        (x0, x1), _ = self.vb.viewRange()
        n = self.doc.replays[self.device].n
        start = max(self.doc.index_at(self.device, x0), 0)
        end = min(self.doc.index_at(self.device, x1) + 2, n)
        return start, max(end, min(start + 1, n))

    def refresh(self):
        """Redraw for the current view: re-query only when the view left the fetched range or zoomed in.

        A query covers the visible entries plus one view width either side at
        about one point per pixel, so panning by less than a screen costs a paint only.
        """
        if self.doc is None:
            return
        rep = self.doc.replays[self.device]
        if rep.n == 0:
            self._draw_constant(rep)
            return
        start, end = self.visible_entries()
        width = max(int(self.vb.width()), 200)
        f = self._fetched
        stale = (f is None or start < f[0] or end > f[1] or f[3] != width
                 or (f[1] - f[0] > f[2] and f[1] - f[0] > 4 * (end - start)))  # downsampled and zoomed in
        if stale:
            span = end - start
            lo, hi = max(start - span, 0), min(end + span, rep.n)
            self._draw(self.doc.series(self.device, start=lo, end=hi, max_points=3 * width), hi)
            self._fetched = (lo, hi, 3 * width, width)
        visible = (self._shown_index >= start - 1) & (self._shown_index < end)
        top = float(self._shown_top[visible].max()) if visible.any() else float(self._shown_top.max(initial=0))
        self._set_top(max(_nice_ceil(max(top / self.scale, 1e-9) * 1.08), self._room_for_labels()))
        self._fit_phase_labels()
        self.last_query = (self._fetched[0], self._fetched[1], width, len(self._shown_index))

    def _draw(self, s, end):
        """Set the curves to a Series (entries up to `end`) as steps: a value holds until the next entry."""
        xs = self.doc.xs(self.device)[0]
        x_end = xs[end] if end < len(xs) else self.doc.x_range(self.device)[1]
        high = slice(None) if s.peaks is None or s.peaks.all() else s.peaks

        def steps_at(points):
            return np.repeat(np.append(xs[s.index[points]], x_end), 2)[1:-1]

        def step(y):
            return np.repeat(np.asarray(y, dtype=np.float64)[high] / self.scale, 2)

        step_x = steps_at(high)
        if isinstance(high, slice):
            self.low_line.setData([], [])
        else:
            low = ~s.peaks
            self.low_line.setData(steps_at(low), np.repeat(s.total[low] / self.scale, 2))
        if self._low_shown != (not isinstance(high, slice)):  # its legend entry while it is drawn
            self._low_shown = not self._low_shown
            self.legend.set_entries(self._legend_entries + [("low between peaks", LOW_COLOR, "line")] * self._low_shown)
        cum = np.zeros(len(s.index))
        for name in self.names:
            values = s.by_category.get(name)
            if values is not None and len(values) and np.any(values[high]):
                cum = cum + values
                self._fills[name].setData(step_x, step(cum))
            else:  # nothing of it here: its fill would lie exactly under the one below it, so none is drawn
                self._fills[name].setData([], [])
        self.total_line.setData(step_x, step(s.total))
        top = np.asarray(s.total, dtype=np.float64)
        if s.reserved is not None and len(s.reserved):
            for item in (self.reserved_line, self.reserved_edge):
                item.setData(step_x, step(s.reserved))
            top = np.maximum(top, s.reserved)
        else:
            self.reserved_line.setData([], [])
            self.reserved_edge.setData([], [])
        self._shown_index, self._shown_top = s.index, top

    def _set_top(self, top):
        """Fix the y range to [0, top]; iteration lines span it, their labels sit at its top."""
        self.vb.setYRange(0, top, padding=0)
        # Boundaries closer than a few pixels would paint the plot solid: drawn only when zoomed in enough.
        (x0, x1), _ = self.vb.viewRange()
        xs = self._iteration_x
        shown = int(np.count_nonzero((xs >= x0) & (xs <= x1))) // 2
        if shown * MIN_ITERATION_SPACING_PX > max(self.vb.width(), 1.0):
            xs = xs[:0]
        self.iteration_lines.setData(xs, np.tile([0.0, top], len(xs) // 2))
        for label in self._iteration_labels + self._highlight[1:]:
            label.setPos(label.pos().x(), top)

    def _room_for_labels(self) -> float:
        """The y range top that keeps every peak/OOM caption in view inside the plot, and their
        horizontal anchors set so none runs off the left or right edge."""
        (x0, x1), _ = self.vb.viewRange()
        height = self.vb.height()
        need = 0.0
        for label, x, y in self._marker_labels:
            if not x0 <= x <= x1:
                continue
            frac = (x - x0) / ((x1 - x0) or 1.0)
            half_width = label.boundingRect().width() / 2 / max(self.vb.width(), 1.0)
            label.setAnchor((0.0 if frac < half_width else 1.0 if frac > 1 - half_width else 0.5, LABEL_LIFT))
            above = (LABEL_LIFT * label.boundingRect().height() + 4) / max(height, 1.0)  # share of the plot height
            if above < 0.8:
                need = max(need, y / (1 - above))
        return need

    def _fit_phase_labels(self):
        """Show a phase's name only where its band is wide enough on screen."""
        per_pixel = self.vb.viewPixelSize()[0] or 1.0
        for text, width, needed_px in self._phase_labels:
            text.setVisible(width / per_pixel >= needed_px)

    def _draw_constant(self, rep):
        """A file with no trace entries (a bare snapshot): one bar of what is live."""
        parts = self.doc.breakdown_at(self.device, -1)
        cum = 0.0
        for name in self.names:
            cum += parts.get(name, 0)
            self._fills[name].setData([0.0, 1.0], [cum / self.scale] * 2)
        self.total_line.setData([0.0, 1.0], [cum / self.scale] * 2)
        self.low_line.setData([], [])
        reserved = rep.initial_reserved
        for item in (self.reserved_line, self.reserved_edge):
            item.setData(*(([0.0, 1.0], [reserved / self.scale] * 2) if reserved else ([], [])))
        self._set_top(max(cum, reserved or 0, 1) / self.scale * 1.12)
        self.last_query = (0, 0, 0, 1)

    # ---- navigation -------------------------------------------------------------

    def reset_zoom(self):
        """The iterations: the whole trace, less a torch.compile warm-up before them (a zoom-out away)."""
        if self.doc is not None:
            self.vb.setXRange(*self.doc.view_range(self.device), padding=0.005)

    def zoom(self, factor):
        """factor < 1 zooms in around the centre (or the pinned cursor when it is in view)."""
        (x0, x1), _ = self.vb.viewRange()
        centre = (x0 + x1) / 2
        if self.cursor_line.isVisible() and x0 <= self.cursor_line.value() <= x1:
            centre = self.cursor_line.value()
        self.vb.scaleBy(x=factor, center=(centre, 0))

    def show_entries(self, start, end=None):
        """Zoom to trace entries [start, end] with a margin, or to a window around one entry."""
        rep = self.doc.replays[self.device]
        if rep.n == 0:
            return
        lo, hi = self.doc.x_range(self.device)
        clamp = lambda i: min(max(int(i), 0), rep.n - 1)  # noqa: E731
        if end is None or end == start:
            x = self.doc.x_of(self.device, clamp(start))
            half = (hi - lo) * 0.03  # 6% of the trace: the spot and its surroundings
            x0, x1 = max(x - half, lo), min(x + half, hi)
        else:
            x0, x1 = self.doc.x_of(self.device, clamp(min(start, end))), self.doc.x_of(self.device, clamp(max(start, end)))
            margin = max((x1 - x0) * 0.15, (hi - lo) * 0.005)
            x0, x1 = max(x0 - margin, lo), min(x1 + margin, hi)
        if x1 <= x0:
            x1 = x0 + (hi - lo) * 0.01
        self.vb.setXRange(x0, x1, padding=0)

    def set_cursor(self, index):
        """Pin the cursor line at a trace entry (None hides it)."""
        if index is None:
            self.cursor_line.hide()
            return
        self.cursor_line.setValue(self.doc.x_of(self.device, index))
        self.cursor_line.show()

    def highlight(self, alloc_index, free_index, size, text=""):
        """Shade an allocation's lifetime (entry -1 = before the trace / live at the end)."""
        self.clear_highlight()
        lo, hi = self.doc.x_range(self.device)
        x0 = lo if alloc_index < 0 else self.doc.x_of(self.device, alloc_index)
        x1 = hi if free_index < 0 else self.doc.x_of(self.device, free_index)
        region = pg.LinearRegionItem((x0, max(x1, x0)), movable=False, brush=pg.mkBrush(_color("#000000", 45)),
                                     pen=pg.mkPen(HIGHLIGHT_COLOR, width=1.5))
        region.setZValue(55)
        (v0, v1), (_, top) = self.vb.viewRange()
        right_half = x0 > (v0 + v1) / 2
        label = pg.TextItem(f"{fmt_bytes(size)} {text}".strip(), color=HIGHLIGHT_COLOR,
                            anchor=(1, 0) if right_half else (0, 0), fill=pg.mkBrush(255, 255, 255, 220))
        label.setZValue(72)
        label.setPos(min(x1, v1) if right_half else max(x0, v0), top)
        for item in (region, label):
            self.plot.addItem(item, ignoreBounds=True)
        self._highlight = [region, label]

    def region_in_view(self, alloc_index, free_index) -> bool:
        """Whether any of an allocation's lifetime is on screen."""
        lo, hi = self.doc.x_range(self.device)
        x0 = lo if alloc_index < 0 else self.doc.x_of(self.device, alloc_index)
        x1 = hi if free_index < 0 else self.doc.x_of(self.device, free_index)
        (v0, v1), _ = self.vb.viewRange()
        return x1 >= v0 and x0 <= v1

    def clear_highlight(self):
        for item in self._highlight:
            self.plot.removeItem(item)
        self._highlight = []

    # ---- mouse ------------------------------------------------------------------

    def _entry_at_scene(self, pos):
        if self.doc is None or not self.plot.sceneBoundingRect().contains(pos):
            return None
        x = self.vb.mapSceneToView(pos).x()
        return x, self.doc.index_at(self.device, x)

    def _mouse_moved(self, event):
        hit = self._entry_at_scene(event[0])
        if hit is None:
            self.hover_line.hide()
            return
        self.hover_line.setValue(hit[0])
        self.hover_line.show()
        self.hovered.emit(hit[1])

    def _mouse_clicked(self, event):
        if event.button() != Qt.LeftButton or event.double():
            return
        hit = self._entry_at_scene(event.scenePos())
        if hit is not None:
            self.set_cursor(max(hit[1], 0))
            self.clicked.emit(hit[1])
