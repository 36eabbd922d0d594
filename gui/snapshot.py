"""A file without a timeline (a bare snapshot): bars of what was live, by category and site.

One horizontal bar per category, split into its largest allocation sites
(the rest of the category's sites as one lighter part), each captioned with
its bytes and its largest site. Computed by `tracekit.analysis.live`.
"""
from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from .palette import category_color, fmt_bytes

SITES_PER_BAR = 4  # sites drawn as their own part of a bar; the rest of the category is one part
CAPTION_CHARS = 110


class SnapshotBars(QWidget):
    """What was live when the snapshot was taken: a bar per category, parts per allocation site."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.caption = QLabel()
        self.caption.setWordWrap(True)
        self.caption.setStyleSheet("padding: 4px 8px; color: #333333")
        self.graphics = pg.PlotWidget(background="w")
        self.plot = self.graphics.getPlotItem()
        self.plot.hideButtons()
        self.plot.setMenuEnabled(False)
        self.plot.setMouseEnabled(x=False, y=False)
        self.plot.getAxis("left").setWidth(120)
        self.plot.showGrid(x=True, y=False, alpha=0.25)
        self.rows: list[dict] = []  # the bars drawn: {category, bytes, count, parts: [(site, bytes)]} (tests)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.caption)
        layout.addWidget(self.graphics, 1)

    def set_rows(self, sites: list[dict], names: list[str], unit: str, scale: float, entries: int):
        """Draw `live_by_site` rows; `names` orders the categories (bottom of the stack first)."""
        self.plot.clear()
        self.rows = []
        for name in names:
            mine = [r for r in sites if r["category"] == name]
            if mine:
                parts = [(r["site"], r["bytes"]) for r in mine[:SITES_PER_BAR]]
                rest = sum(r["bytes"] for r in mine[SITES_PER_BAR:])
                if rest:
                    parts.append((f"{len(mine) - SITES_PER_BAR} more sites", rest))
                self.rows.append({"category": name, "bytes": sum(r["bytes"] for r in mine),
                                  "count": sum(r["count"] for r in mine), "parts": parts, "sites": len(mine)})
        total = sum(r["bytes"] for r in self.rows)
        what = "a snapshot with no allocations or frees in its trace" if entries else "a snapshot without a trace"
        self.caption.setText(f"<b>{fmt_bytes(total)}</b> live when the snapshot was taken, by category and "
                             f"allocation site. This file is {what}: there is no timeline to draw.")
        if not self.rows:
            return
        longest = max(r["bytes"] for r in self.rows) / scale
        ticks = []
        for y, row in enumerate(reversed(self.rows)):  # the first category at the top
            colour = QColor(category_color(row["category"], names))
            x = 0.0
            for i, (_, nbytes) in enumerate(row["parts"]):
                shade = QColor(colour)
                shade.setAlphaF(1.0 - 0.55 * i / max(len(row["parts"]) - 1, 1))
                width = nbytes / scale
                self.plot.addItem(pg.BarGraphItem(x0=[x], width=[width], y=[y], height=0.5,
                                                  brush=pg.mkBrush(shade), pen=pg.mkPen("w", width=1)))
                x += width
            top_site, top_bytes = row["parts"][0]
            share = top_bytes / row["bytes"] if row["bytes"] else 0
            text = (f"{fmt_bytes(row['bytes'])} · {row['count']:,} allocations · "
                    f"{_elide(top_site)} ({share:.0%})" + (f" and {row['sites'] - 1} more sites"
                                                            if row["sites"] > 1 else ""))
            label = pg.TextItem(text, color="#222222", anchor=(0, 1))  # above its bar, inside the plot
            label.setPos(0, y + 0.27)
            self.plot.addItem(label)
            ticks.append((y, row["category"].replace("_", " ")))
        self.plot.getAxis("left").setTicks([ticks])
        self.plot.setLabel("bottom", f"live memory ({unit})")
        self.plot.setXRange(0, longest * 1.04, padding=0)
        self.plot.setYRange(-0.5, len(self.rows) - 0.2, padding=0)


def _elide(text: str, limit=CAPTION_CHARS) -> str:
    return text if len(text) <= limit else "…" + text[-(limit - 1):]

