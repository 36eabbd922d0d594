"""One opened file and the analysis results the viewer shows, built off the GUI thread.

`Document` is a thin adapter over tracekit's API: it calls `tracekit.load`,
`replay`, `categorize`, `category_series` and `build_report` and maps trace
entries to x positions (seconds since the first entry, or the entry index when
the file has no times). It computes no analysis of its own.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

import tracekit
from tracekit.analysis.frames import user_first, where
from tracekit.analysis.replay import replay
from tracekit.errors import Cancelled
from tracekit.model import NO_TIME

METHODS = ("tag", "rule", "inferred")


def _optional(module: str):
    """An analysis module that may not exist yet in this checkout (None if missing)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def _call(module: str, function: str, *args):
    """module.function(*args), or None while that analysis is not (fully) in this checkout."""
    mod = _optional(module)
    try:
        return getattr(mod, function)(*args) if mod is not None and hasattr(mod, function) else None
    except ImportError:
        return None


@dataclass
class Document:
    path: str
    trace: object
    replays: dict
    report: dict
    categories: dict | None  # device -> DeviceCategories, None when unavailable
    phases: dict | None = None  # device -> DevicePhases (tracekit.analysis.phases)
    _xs: dict = field(default_factory=dict)
    _where: dict = field(default_factory=dict)

    # ---- building ---------------------------------------------------------

    @classmethod
    def open(cls, path, progress=None, cancelled=lambda: False, use_cache=True) -> "Document":
        """Load and analyse `path`. `progress(fraction, message)`; raises Cancelled when `cancelled()`."""
        def step(lo, hi):
            def cb(fraction, message):
                if cancelled():
                    raise Cancelled()
                if progress:
                    progress(lo + (hi - lo) * float(fraction), message)
            return cb

        trace = tracekit.load(path, progress=step(0.0, 0.7), use_cache=use_cache)
        step(0.7, 1)(0.0, "replaying allocations")
        replays = replay(trace)
        step(0.75, 1)(0.0, "classifying memory")
        categories = _call("tracekit.analysis.categories", "categorize", trace)
        step(0.85, 1)(0.0, "finding peaks, spikes and leaks")
        report = _call("tracekit.analysis.report", "build_report", trace) or {"devices": [], "findings": []}
        phases = _call("tracekit.analysis.phases", "phases", trace)
        doc = cls(str(path), trace, replays, report, categories, phases)
        step(0.95, 1)(0.0, "preparing tables")
        for d in trace.devices:
            doc.where_table(d)
        return doc

    # ---- devices and report ----------------------------------------------

    @property
    def devices(self) -> list:
        return list(self.trace.devices)

    def default_device(self):
        """The device with the highest peak: what a user opens the file for."""
        return max(self.devices, key=lambda d: self.replays[d].peak_allocated or 0)

    def label(self, device) -> str:
        return self.trace.device_label(device)

    def device_report(self, device) -> dict:
        for d in self.report.get("devices", []):
            if d.get("device") == device:
                return d
        return {}

    def findings(self, device=None) -> list[dict]:
        return [f for f in self.report.get("findings", []) if device is None or f.get("device") in (device, None)]

    # ---- x axis ------------------------------------------------------------

    def has_time(self, device) -> bool:
        return self.xs(device)[1]

    def xs(self, device):
        """(x of every entry, is_time): seconds since the trace's first time, else the entry index."""
        if device not in self._xs:
            t = self.trace.events.time_us[self.replays[device].events]
            valid = t != NO_TIME
            if valid.any():
                all_t = self.trace.events.time_us
                t0 = all_t[all_t != NO_TIME].min()
                # entries without a time sit at their predecessor's time (monotone for lookups)
                filled = np.maximum.accumulate(np.where(valid, t, np.iinfo(np.int64).min))
                filled = np.where(filled == np.iinfo(np.int64).min, t[valid][0], filled)
                self._xs[device] = ((filled - t0) / 1e6, True)
            else:
                self._xs[device] = (np.arange(len(t), dtype=np.float64), False)
        return self._xs[device]

    def x_of_time(self, device, time_us) -> float | None:
        """x of a recorder time stamp (phases, iterations); None when the axis is not time."""
        if not self.has_time(device):
            return None
        all_t = self.trace.events.time_us
        return (float(time_us) - float(all_t[all_t != NO_TIME].min())) / 1e6

    def phase_spans(self, device) -> list[tuple]:
        """(phase, iteration, x0, x1) of each run of a training phase, on this device's x axis."""
        if self.phases is not None:
            from tracekit.analysis.phases import PHASES

            p = self.phases[device]
            return [(PHASES[code], it, self.x_of(device, first), self._x_after(device, last))
                    for it, code, first, last in p.intervals()]
        out = []
        for p in (self.trace.recorder or {}).get("phases") or []:
            x0, x1 = self.x_of_time(device, p["start_us"]), self.x_of_time(device, p["end_us"])
            if x0 is not None and x1 is not None:
                out.append((p.get("phase", ""), p.get("iteration"), x0, x1))
        return out

    def phase_at(self, device, index) -> str:
        """"forward, iteration 3" at a trace entry ("" when unknown)."""
        if self.phases is None or index < 0 or index >= self.phases[device].n:
            return ""
        from tracekit.analysis.phases import PHASES

        p = self.phases[device]
        name, it = PHASES[int(p.phase[index])], int(p.iteration[index])
        text = "" if name == "none" else name
        return f"{text}, iteration {it}" if it >= 0 and text else (text or (f"iteration {it}" if it >= 0 else ""))

    def iteration_starts(self, device) -> list[tuple]:
        """(iteration, x) where each iteration begins."""
        if self.phases is not None:
            return [(it, self.x_of(device, first)) for it, first, _ in self.phases[device].iterations()]
        out = []
        for it in (self.trace.recorder or {}).get("iterations") or []:
            x = self.x_of_time(device, it["start_us"])
            if x is not None:
                out.append((it.get("iteration"), x))
        return out

    def x_of(self, device, index) -> float:
        x = self.xs(device)[0]
        if len(x) == 0:
            return 0.0
        return float(x[min(max(int(index), 0), len(x) - 1)])

    def _x_after(self, device, index) -> float:
        """x where entry `index` stops being the latest (the next entry, or the end)."""
        n = self.replays[device].n
        return self.x_of(device, index + 1) if index + 1 < n else self.x_range(device)[1]

    def x_range(self, device) -> tuple[float, float]:
        x, is_time = self.xs(device)
        if len(x) == 0:
            return 0.0, 1.0
        lo, hi = float(x[0]), float(x[-1])
        return (lo, hi + 1.0) if not is_time else (lo, hi if hi > lo else lo + 1e-6)

    def index_at(self, device, x) -> int:
        """The trace entry in effect at position x (-1 before the first)."""
        xs = self.xs(device)[0]
        return int(np.searchsorted(xs, x, side="right")) - 1

    # ---- curves --------------------------------------------------------------

    def category_names(self, device) -> list[str]:
        """The stacked curves: the categories, or one "allocated" curve without them."""
        if self.categories is not None and _optional("tracekit.analysis.timeline") is not None:
            return list(self.categories[device].names)
        return ["allocated"]

    def series(self, device, start=None, end=None, max_points=None):
        """Memory by category over [start, end) entries, at most max_points points."""
        tl = _optional("tracekit.analysis.timeline")
        if tl is not None and self.categories is not None:
            return tl.category_series(self.trace, device, max_points=max_points, start=start, end=end)
        return _fallback_series(self.replays[device], self.trace, start, end, max_points)

    def breakdown_at(self, device, index) -> dict:
        """Bytes by category just after entry `index` (-1: before the first)."""
        rep = self.replays[device]
        index = min(index, rep.n - 1)
        if self.categories is None:
            return {"allocated": rep.allocated_at(index)}
        al = rep.allocations
        return self.categories[device].bytes_by_category(al.size, al.live_at(index))

    # ---- allocations ---------------------------------------------------------

    def labels(self, device):
        """(labels, names, method) of the device's allocations, or None without categories."""
        if self.categories is None:
            return None
        c = self.categories[device]
        return c.labels, list(c.names), c.method

    def where_table(self, device):
        """(strings, ids): the top user frame of each allocation, as an index into unique strings."""
        if device not in self._where:
            sid = self.replays[device].allocations.stack_id
            uniq, inv = np.unique(sid, return_inverse=True)
            strings = np.array([where(user_first(self.trace.stack(int(s)))) if s >= 0 else "(no stack recorded)"
                                for s in uniq], dtype=object)
            self._where[device] = (strings, inv.astype(np.int32))
        return self._where[device]


def _fallback_series(rep, trace, start, end, max_points):
    """TEMPORARY (gui): the plain allocated curve, min/max-decimated, until
    tracekit.analysis.timeline.category_series lands. Same fields as its Series."""
    n = rep.n
    start = 0 if start is None else max(int(start), 0)
    end = n if end is None else min(int(end), n)
    idx = np.arange(start, end, dtype=np.int64)
    if max_points and len(idx) > max_points:
        buckets = max(max_points // 2, 1)
        edges = np.linspace(start, end, buckets + 1).astype(np.int64)
        seg = rep.allocated[start:end]
        keep = []
        for b in range(buckets):
            s = seg[edges[b] - start:edges[b + 1] - start]
            if len(s):
                a, z = edges[b] + int(np.argmin(s)), edges[b] + int(np.argmax(s))
                keep += sorted((a, z))
        idx = np.unique(np.array(keep, dtype=np.int64))
    t = trace.events.time_us[rep.events][idx] if trace.has_time else None
    reserved = rep.reserved[idx] if rep.reserved is not None else None
    return SimpleNamespace(index=idx, time_us=t, by_category={"allocated": rep.allocated[idx]},
                           total=rep.allocated[idx], reserved=reserved)
