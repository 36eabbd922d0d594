"""One opened file and the analysis results the viewer shows, built off the GUI thread.

`Document` is a thin adapter over tracekit's API: it calls `tracekit.load`,
`replay`, `categorize`, `category_series` and `build_report` and maps trace
entries to x positions (seconds since the first entry, or the entry index when
the file has no times). It computes no analysis of its own.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import numpy as np

import tracekit
from tracekit.io.cache import memo
from tracekit.io.cache.folder import code_stamp, join_all
from tracekit.analysis.categories import categorize
from tracekit.analysis.live import has_timeline, live_by_site
from tracekit.analysis.sites import allocation_sites, allocation_where, site_frames, site_info
from tracekit.analysis.phases import PHASES, phases
from tracekit.analysis.replay import replay
from tracekit.analysis.report import build_report
from tracekit.analysis.timeline import categories_at, category_series, time_origin
from tracekit.analysis.window import select
from tracekit.errors import Cancelled
from tracekit.model import NO_TIME

_CODE = " viewer=" + code_stamp(os.path.dirname(os.path.abspath(__file__)))  # what the stored extras depend on
KEEP_BEHIND_BYTES = 64 << 20  # a file this big keeps its analysis for the next open after the first paint
_keeping: list[threading.Thread] = []  # the threads keeping a document's analysis (not daemons: finished at exit)


def wait_kept() -> None:
    """Wait for the analyses being kept for the next open (Document.open of a big file)."""
    join_all(_keeping)



@dataclass
class Document:
    path: str
    trace: object
    replays: dict
    report: dict
    categories: dict  # device -> DeviceCategories
    phases: dict  # device -> DevicePhases
    _xs: dict = field(default_factory=dict)
    _where: dict = field(default_factory=dict)
    _kept: dict = field(default_factory=dict)  # (what, device) -> spans, series, table orders (kept())

    # ---- building ---------------------------------------------------------

    @classmethod
    def open(cls, path, progress=None, cancelled=lambda: False, use_cache=True, window=None) -> "Document":
        """Load and analyse `path` (cut to `window`, a tracekit.analysis.window.Window, if given).
        `progress(fraction, message)`; raises Cancelled when `cancelled()`."""
        def tell(fraction, message):
            if cancelled():
                raise Cancelled()
            if progress:
                progress(fraction, message)

        wait_kept()  # an analysis still being kept from the last open (of this file, maybe)
        whole = trace = tracekit.load(path, progress=lambda f, m: tell(0.7 * float(f), m), use_cache=use_cache,
                                      window=window, write_behind=True)  # the entry written beside the analysis
        streamed = "streamed_window" in whole.meta  # only the window was read (a big file, not cached)
        stored = memo.restore(whole, path) if use_cache and not streamed else None
        if window:
            trace = select(whole, window)
        if use_cache:
            if window:  # the window's analysis, stored apart from the viewer's extras (a big file: _Early)
                memo.restore(trace, path, window)
            stored = memo.restore(trace, path, window, code=_CODE)
        tell(0.7, "replaying allocations")
        replays = replay(trace)
        tell(0.75, "classifying memory")
        categories = categorize(trace)
        tell(0.85, "finding peaks, spikes and leaks")
        report = stored["report"] if stored and isinstance(stored.get("report"), dict) else build_report(trace)
        keep = use_cache and stored is None
        early = None
        if keep and os.path.getsize(path) >= KEEP_BEHIND_BYTES:
            # a big file: the analysis so far (most of what is kept) is written now, on a thread (writing lets go
            # of the GIL), beside the tables below and the first paint; _keep writes the rest with the extras
            early = _Early(trace, path, window)
        doc = cls(str(path), trace, replays, report, categories, phases(trace))
        if stored:
            doc._xs.update(stored.get("xs") or {})
            doc._kept.update(stored.get("kept") or {})
            doc._where.update(stored.get("where") or {})
        tell(0.95, "preparing tables")
        for d in trace.devices:
            doc.where_table(d)
            doc.phase_spans(d), doc.iteration_starts(d)
            doc._first_paint(d, keep)
        if early is not None:  # on a thread, beside the first paint
            # not a daemon (a thread started by the loader's daemon would be one): finished before exit
            t = threading.Thread(target=doc._keep, args=(whole, window, early), name="tracekit-keep", daemon=False)
            _keeping.append(t)
            t.start()
        elif keep:
            tell(0.97, "keeping the analysis for the next open")
            doc._keep(whole, window)
        return doc

    def _first_paint(self, device, keep=False) -> None:
        """What the window's first paint asks of `device` (the tables' columns and default order, whether it has a
        timeline), made here off the GUI thread and before the analysis is kept, so that it is computed once and
        stored with it; with `keep`, the curves at every width the timeline asks for too (else it asks for one)."""
        self.table_order(device, "size", self.replays[device].allocations.size)
        self.has_timeline(device)
        self.library_table(device)
        self.module_table(device)
        if keep:
            for points in (1024, 2048, 4096, 8192):
                self.series(device, max_points=points)

    def _keep(self, whole, window, early: "_Early | None" = None) -> None:
        """Store the analysis (memo.store) with what the first paint asks for, for the next open; after `early`
        (the analysis up to the report, stored apart), only what was analysed since."""
        trace, path = self.trace, self.path
        # first: the early store waits for the cache's entry to be written (folder.wait_written), a store of ours
        # beside it would not (the one waiting takes the writer off the list) and find no entry yet
        done = early.wait() if early is not None else frozenset()
        for d in trace.devices:
            self._first_paint(d, keep=True)  # made by open() already: nothing is computed twice
        if window:
            memo.store(whole, path)
        # copies: the GUI thread may add to them meanwhile
        extra = {"report": self.report, "xs": dict(self._xs), "kept": dict(self._kept), "where": dict(self._where)}
        memo.store(trace, path, window, extra=extra, code=_CODE, leave_out=done)

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
                t0 = time_origin(self.trace)  # the report's time base too
                # entries without a time sit at their predecessor's time (monotone for lookups)
                filled = np.maximum.accumulate(np.where(valid, t, np.iinfo(np.int64).min))
                filled = np.where(filled == np.iinfo(np.int64).min, t[valid][0], filled)
                self._xs[device] = ((filled - t0) / 1e6, True)
            else:
                self._xs[device] = (np.arange(len(t), dtype=np.float64), False)
        return self._xs[device]

    def phase_spans(self, device) -> list[tuple]:
        """(phase, iteration, x0, x1) of each run of a training phase, on this device's x axis; in a generation
        the phase of a decoding step is "step k" (its number after the prefill)."""
        if ("spans", device) not in self._kept:
            p = self.phases[device]
            spans = []
            for it, code, first, last in p.intervals():
                name = PHASES[code]
                if p.generation is not None and name == "decode":
                    from tracekit.analysis.phases import decode_step

                    name = f"step {decode_step(p, it)}"
                spans.append((name, it, self.x_of(device, first), self._x_after(device, last)))
            self._kept["spans", device] = spans
        return self._kept["spans", device]

    def phase_at(self, device, index) -> str:
        """"forward, iteration 3" at a trace entry ("" when unknown); "decoding step 5" in a generation."""
        p = self.phases[device]
        if index < 0 or index >= p.n:
            return ""
        if p.generation is not None:
            from tracekit.analysis.phases import when

            return when(self.trace, device, int(index))[2]
        name, it = PHASES[int(p.phase[index])], int(p.iteration[index])
        parts = ([name] if name != "none" else []) + ([f"iteration {it}"] if it >= 0 else [])
        return ", ".join(parts)

    def iteration_starts(self, device) -> list[tuple]:
        """(iteration, x) where each iteration begins."""
        if ("starts", device) not in self._kept:
            self._kept["starts", device] = [(it, self.x_of(device, first))
                                            for it, first, _ in self.phases[device].iterations()]
        return self._kept["starts", device]

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

    def warmup(self, device) -> dict | None:
        """torch.compile's warm-up on this device (tracekit.analysis.warmup), or None."""
        if ("warmup", device) not in self._kept:
            from tracekit.analysis.warmup import compile_warmup

            self._kept["warmup", device] = compile_warmup(self.trace, device)
        return self._kept["warmup", device]

    def view_range(self, device) -> tuple[float, float]:
        """The x range the timeline opens on: the whole trace, or the iterations after a compile warm-up
        (which on a time axis would squeeze them into the right edge)."""
        lo, hi = self.x_range(device)
        w = self.warmup(device)
        if w is None:
            return lo, hi
        return self.x_of(device, w["last_index"] + 1), hi

    def index_at(self, device, x) -> int:
        """The trace entry in effect at position x (-1 before the first)."""
        xs = self.xs(device)[0]
        return int(np.searchsorted(xs, x, side="right")) - 1

    # ---- curves --------------------------------------------------------------

    def category_names(self, device) -> list[str]:
        """The categories, in stacking order (bottom first)."""
        return list(self.categories[device].names)

    def series(self, device, start=None, end=None, max_points=None):
        """Memory by category over entries [start, end), at most max_points points (min/max envelope).
        Over the whole trace, `max_points` is rounded down to a power of two (at least 1024) and the
        result kept (and stored with the analysis), so the first paint of a warm file computes nothing."""
        n = self.replays[device].n
        if max_points and (start or 0) <= 0 and (end is None or end >= n):
            points = max(1024, 1 << (int(max_points).bit_length() - 1))
            return self.kept(("series", points), device,
                             lambda: category_series(self.trace, device, max_points=points))
        return category_series(self.trace, device, max_points=max_points, start=start, end=end)

    def kept(self, what, device, compute):
        """compute(), kept under (what, device) for this document (and stored with its analysis)."""
        if (what, device) not in self._kept:
            self._kept[what, device] = compute()
        return self._kept[what, device]

    def table_order(self, device, column, key):
        """Rows of all allocations sorted by `key` (stable, ascending), kept per `column`."""
        return self.kept(("order", column), device, lambda: np.argsort(key, kind="stable"))

    def has_timeline(self, device) -> bool:
        """False for a bare snapshot: nothing is allocated or freed in its trace, so nothing moves in time."""
        return self.kept("has_timeline", device, lambda: bool(has_timeline(self.trace, device)))

    def live_by_site(self, device) -> list[dict]:
        """What is live at the end, by category and allocation site (see tracekit.analysis.live)."""
        return live_by_site(self.trace, device)

    def breakdown_at(self, device, index) -> dict:
        """Bytes by category just after entry `index` (-1: before the first)."""
        index = min(int(index), self.replays[device].n - 1)
        return {name: int(v[0]) for name, v in categories_at(self.trace, device, [index]).items()}

    # ---- allocations ---------------------------------------------------------

    def labels(self, device):
        """(labels, names, method) of the device's allocations."""
        c = self.categories[device]
        return c.labels, list(c.names), c.method

    def reason(self, device, row) -> str:
        c = self.categories[device]
        return c.reasons[int(c.reason[row])]

    def allocation_frames(self, device, row) -> list:
        """An allocation's whole stack, the user's line first (borrowed from its pass when it has none)."""
        rep = self.replays[device]
        site = allocation_sites(self.trace, rep).site_stack[row]
        return site_frames(self.trace, int(rep.allocations.stack_id[row]), int(site))

    def allocation_origin(self, device, row) -> tuple[str | None, str | None]:
        """(the forward line whose backward made it, as "backward of file:line in f", or None; its module)."""
        rep = self.replays[device]
        sites = allocation_sites(self.trace, rep)
        module = int(sites.module[row])
        name = self.trace.strings[module] if module > 0 else None
        if not sites.forward[row]:
            return None, name
        info = site_info(self.trace, int(rep.allocations.stack_id[row]), int(sites.site_stack[row]), True)
        return info["where"], name

    def library_table(self, device):
        """(strings, ids): the library line of each allocation ("" where none), as an index into unique strings."""
        from tracekit.analysis.libraries import allocation_library_where

        return self.kept("library", device, lambda: allocation_library_where(self.trace, device))

    def module_table(self, device):
        """(strings, ids): the module of each allocation ("" where none: recorder tags, else from the stacks)."""
        from tracekit.analysis.modules import allocation_module_names

        return self.kept("modules", device, lambda: allocation_module_names(self.trace, self.replays[device]))

    def library_how(self, device, row) -> str:
        """How an allocation's library line was found (its stack, or its autograd node's forward op)."""
        from tracekit.analysis.libraries import HOW, allocation_libraries

        return HOW[int(allocation_libraries(self.trace, device).how[row])] or "nothing"

    def module_how(self, device, row) -> str:
        """Where an allocation's module comes from: the recorder's tags, or the stacks (and how)."""
        from tracekit.analysis.modules import allocation_module_ids
        from tracekit.analysis.modtree import HOWS, allocation_modules

        _, _, source, classes, names = allocation_module_ids(self.trace, self.replays[device])
        if source != "stacks":
            return "recorded by tracekit's recorder"
        am = allocation_modules(self.trace, device)
        chain = names[int(am.classes[row])]
        return f"{chain} — from the stack's forward frames, {HOWS[int(am.how[row])]}"

    def kv_series(self, device, max_points=4096):
        """(x, bytes) of a generation's KV cache over the trace (min/max envelope), or None."""
        if not (self.device_report(device).get("kv_cache")):
            return None

        def compute():
            from tracekit.analysis.generation import kv_curve
            from tracekit.analysis.timeline import envelope

            curve = kv_curve(self.trace, device)
            idx = envelope(curve, 0, len(curve), max_points)
            return self.xs(device)[0][idx], curve[idx].astype(np.float64)
        return self.kept("kv", device, compute)

    def where_table(self, device):
        """(strings, ids): the top user frame of each allocation, as an index into unique strings."""
        if device not in self._where:
            self._where[device] = allocation_where(self.trace, self.replays[device])
        return self._where[device]


class _Early:
    """memo.store of a trace's analysis so far, under tracekit's own code (no extras), on a thread of its own."""

    def __init__(self, trace, path, window):
        self.keys = frozenset(trace.__dict__.get("_memo", {}))  # (store takes at least these)
        self.ok = False
        self._thread = threading.Thread(target=self._run, args=(trace, path, window), name="tracekit-keep-early",
                                        daemon=False)
        _keeping.append(self._thread)
        self._thread.start()

    def _run(self, trace, path, window):
        self.ok = memo.store(trace, path, window)

    def wait(self) -> frozenset:
        """The memo keys stored (none when the store failed: then the viewer's entry takes them all)."""
        self._thread.join()
        return self.keys if self.ok else frozenset()
