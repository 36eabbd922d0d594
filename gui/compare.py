"""Two recordings compared: both timelines on one shared axis (phase and iteration, not seconds) and
one scale, what changed (tracekit.analysis.diff), and the allocations behind a change on both sides."""
from __future__ import annotations

import os

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import (QHeaderView, QLabel, QSplitter, QTableWidget, QTableWidgetItem, QTreeWidget,
                               QTreeWidgetItem, QVBoxLayout, QWidget)

from tracekit.analysis.align import SLOT_NAMES, aligned_difference, aligned_series
from tracekit.analysis.categories import categorize
from tracekit.analysis.diff import diff
from tracekit.analysis.replay import replay
from tracekit.analysis.sites import allocation_where
from tracekit.render.diff import change_text, relative, signed

from .palette import category_color, fmt_bytes

MAX_ROWS = 200  # allocations listed per side


class ComparePlot(pg.PlotWidget):
    """One file's memory stacked by category on the shared axis."""

    def __init__(self, title, series, names, parent=None):
        super().__init__(parent, background="w")
        self.setTitle(title, color="#222", size="10pt")
        self.getAxis("left").setLabel("MiB")
        self.showGrid(y=True, alpha=0.2)
        x = series["x"]
        cum = np.zeros(len(x))
        layers = []
        for name in names:
            cum = cum + series["by_category"].get(name, np.zeros(len(x)))
            layers.append((name, cum.copy()))
        for name, top in reversed(layers):  # the largest sum first: each smaller one is drawn over it
            self.addItem(pg.PlotDataItem(x, top / 2**20, pen=None, fillLevel=0,
                                         brush=pg.mkBrush(category_color(name, names))))
        self.addItem(pg.PlotDataItem(x, series["total"] / 2**20, pen=pg.mkPen("#222", width=1)))
        for x0, it in series["iterations"]:
            self.addItem(pg.InfiniteLine(x0, pen=pg.mkPen("#999", style=Qt.DashLine)))
        self.getAxis("bottom").setTicks([phase_ticks(series["iterations"])])


class DifferencePlot(pg.PlotWidget):
    """B − A per category over the aligned step (one line each; zero is no change)."""

    def __init__(self, delta, names, iterations, parent=None):
        super().__init__(parent, background="w")
        self.setTitle("B − A, by category, over the aligned step", color="#222", size="10pt")
        self.getAxis("left").setLabel("MiB")
        self.showGrid(y=True, alpha=0.2)
        self.addItem(pg.InfiniteLine(0, angle=0, pen=pg.mkPen("#555")))
        for name, values in delta["by_category"].items():
            self.plot(delta["x"], values / 2**20, pen=pg.mkPen(category_color(name, names), width=2), name=name)
        self.plot(delta["x"], delta["total"] / 2**20, pen=pg.mkPen("#222", width=1, style=Qt.DashLine))
        for x0, _ in iterations:
            self.addItem(pg.InfiniteLine(x0, pen=pg.mkPen("#999", style=Qt.DashLine)))
        self.getAxis("bottom").setTicks([phase_ticks(iterations)])


def phase_ticks(iterations) -> list:
    """Axis labels at the middle of each iteration's forward, backward and optimizer slots."""
    return [(x0 + k + 0.5, f"{SLOT_NAMES[k]}" + (f" (it {it})" if k == 1 else ""))
            for x0, it in iterations for k in range(1, 4)]


class CompareView(QWidget):
    """A (before) against B (after), every change B − A."""

    def __init__(self, trace_a, trace_b, result=None, parent=None):
        super().__init__(parent)
        self.traces = (trace_a, trace_b)
        self.result = result or diff(trace_a, trace_b)
        layout = QVBoxLayout(self)
        if not self.result["devices"]:
            layout.addWidget(QLabel("The two files have no device in common."))
            return
        self.pair = self.result["devices"][0]
        devs = (self.pair["device_a"], self.pair["device_b"])
        pk = self.pair["peak_allocated_bytes"]
        head = QLabel(f"<b>A</b> {os.path.basename(trace_a.path)} &nbsp; <b>B</b> {os.path.basename(trace_b.path)}"
                      f" &nbsp;—&nbsp; peak {fmt_bytes(pk['a'])} → {fmt_bytes(pk['b'])}: <b>{change_text(pk)}</b>"
                      f" &nbsp;(changes under {fmt_bytes(self.pair['noise_bytes'])} are noise)")
        layout.addWidget(head)
        series = [aligned_series(t, d) for t, d in zip(self.traces, devs)]
        names = [n for n in categorize(trace_a)[devs[0]].names]
        names += [n for n in categorize(trace_b)[devs[1]].names if n not in names]
        present = [n for n in names if any(s["by_category"].get(n, np.zeros(1)).any() for s in series)]
        legend = QLabel("&nbsp;&nbsp;".join(f'<span style="color:{category_color(n, names)}; font-size:15px">■</span>'
                                            f"&nbsp;{n}" for n in present)
                        + "&nbsp;&nbsp;&nbsp;x: the n-th recorded iteration of each file, split by phase")
        layout.addWidget(legend)
        self.plots = [ComparePlot(f"{label}: {os.path.basename(t.path)}", s, names)
                      for label, t, s in zip("AB", self.traces, series)]
        top = max(float(s["total"].max()) if len(s["total"]) else 0 for s in series) / 2**20 * 1.05 or 1
        for p in self.plots:
            p.setYRange(0, top, padding=0)
        self.plots[1].setXLink(self.plots[0])
        self.plots[1].setYLink(self.plots[0])
        self.delta = DifferencePlot(aligned_difference(*series), names, series[0]["iterations"])
        self.delta.setXLink(self.plots[0])
        self.tree = QTreeWidget()
        self.tree.setHeaderLabels(["change", "what"])
        self.tree.header().setSectionResizeMode(1, QHeaderView.Stretch)
        self._fill_tree()
        self.tree.currentItemChanged.connect(self._picked)
        self.sides = [QTableWidget(0, 4) for _ in range(2)]
        for label, t in zip("AB", self.sides):
            t.setHorizontalHeaderLabels(["bytes", "category", "why", "entry"])
            t.horizontalHeader().setSectionResizeMode(2, QHeaderView.Stretch)
            t.setToolTip(f"{label}: the allocations behind the selected change, live at the peak")
        self.side_labels = [QLabel("A: pick a category, site or module on the right"), QLabel("B:")]
        plots = QSplitter(Qt.Vertical)
        for p in self.plots + [self.delta]:
            plots.addWidget(p)
        upper = QSplitter(Qt.Horizontal)
        upper.addWidget(plots)
        upper.addWidget(self.tree)
        upper.setSizes([900, 500])
        lower = QSplitter(Qt.Horizontal)
        for lab, table in zip(self.side_labels, self.sides):
            box = QWidget()
            v = QVBoxLayout(box)
            v.setContentsMargins(0, 0, 0, 0)
            v.addWidget(lab)
            v.addWidget(table)
            lower.addWidget(box)
        body = QSplitter(Qt.Vertical)
        body.addWidget(upper)
        body.addWidget(lower)
        body.setSizes([600, 250])
        layout.addWidget(body)

    # ---- what changed ------------------------------------------------------------------------

    def _section(self, title, rows):
        if not rows:
            return
        top = QTreeWidgetItem([title, ""])
        self.tree.addTopLevelItem(top)
        for change, what, key in rows:
            item = QTreeWidgetItem([change, what])
            item.setData(0, Qt.UserRole, key)
            top.addChild(item)
        top.setExpanded(True)

    def _fill_tree(self):
        d = self.pair
        cats = sorted(((k, c) for k, c in d["categories_at_peak"].items() if c["significant"]),
                      key=lambda kc: -abs(kc[1]["change"]))
        self._section("at the peak, by category", [(change_text(c), f"{k}: {fmt_bytes(c['a'])} → {fmt_bytes(c['b'])}",
                                                    ("category", k)) for k, c in cats])
        self._section("aligned by phase", [(change_text(p["peak_bytes"]), f"{p['phase']} peak", None)
                                           for p in d["phases"] if p["peak_bytes"]["significant"]])
        self._section("at the peak, by site", [(f"{signed(s['change'])} ({relative(s)})",
                                                f"{s['category']}  {s['site']}", ("site", s["site"]))
                                               for s in d["sites_at_peak"]])
        self._section("at the peak, by module", [(f"{signed(m['change'])} ({relative(m)})",
                                                  f"{m['category']}  {m['module']}", ("module", m["module"]))
                                                 for m in d.get("modules_at_peak") or []])
        f = self.result["findings"]
        self._section("findings", [("new in B", r["summary"], None) for r in f["added"]]
                      + [("gone in B", r["summary"], None) for r in f["removed"]]
                      + [(change_text(r["bytes"]), r["summary"], None) for r in f["changed"]])
        self.tree.resizeColumnToContents(0)

    def _picked(self, item, _previous=None):
        key = item.data(0, Qt.UserRole) if item is not None else None
        if key:
            self.show_allocations(*key)

    # ---- the allocations behind a change --------------------------------------------------------

    def show_allocations(self, kind, name) -> list[int]:
        """List, on both sides, the allocations live at the peak from site (or module) `name`; returns their bytes."""
        totals = []
        for label, trace, dev, table, lab in zip("AB", self.traces, (self.pair["device_a"], self.pair["device_b"]),
                                                 self.sides, self.side_labels):
            rep = replay(trace)[dev]
            rows = np.flatnonzero(rep.allocations.live_at(rep.peak_index) & self._matches(trace, rep, kind, name))
            rows = rows[np.argsort(-rep.allocations.size[rows], kind="stable")]
            cats = categorize(trace)[dev]
            total = int(rep.allocations.size[rows].sum())
            totals.append(total)
            lab.setText(f"{label}: {len(rows)} allocations, {fmt_bytes(total)} live at the peak from {name}")
            table.setRowCount(min(len(rows), MAX_ROWS))
            for i, r in enumerate(rows[:MAX_ROWS].tolist()):
                cells = [fmt_bytes(rep.allocations.size[r]), cats.names[cats.labels[r]], cats.reasons[cats.reason[r]],
                         str(int(rep.allocations.alloc_index[r]))]
                for j, text in enumerate(cells):
                    table.setItem(i, j, QTableWidgetItem(text))
        return totals

    @staticmethod
    def _matches(trace, rep, kind, name) -> np.ndarray:
        if kind == "category":
            cats = categorize(trace)[rep.device]
            return np.asarray(cats.names, dtype=object)[cats.labels] == name
        if kind == "site":
            strings, ids = allocation_where(trace, rep)
            return strings[ids] == name
        from tracekit.analysis.tables import tag_names

        _, module = tag_names(trace, rep)
        want = "" if name == "(the model itself)" else name
        return np.array([m == want for m in module], bool)



def start_compare(window, path_a, path_b):
    """A comparison tab for two files, loaded and compared off the GUI thread."""
    import tracekit

    from .background import BackgroundTab

    def work():
        a, b = tracekit.load(path_a), tracekit.load(path_b)
        return a, b, diff(a, b)

    title = f"{os.path.basename(path_a)} vs {os.path.basename(path_b)}"
    return BackgroundTab(window, title, f"Comparing {path_a} with {path_b}…", work,
                         lambda abr: CompareView(*abr)).start()
