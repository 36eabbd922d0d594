"""`tracekit.load(path)`: a loaded memory file with pandas views, the report and a notebook summary.

A `Recording` *is* the columnar `Trace` (every analysis takes it as it is),
with methods on top:

    rec = tracekit.load("step.pickle")
    rec.allocations()              # one row per allocation (see analysis/tables.py)
    rec.events()                   # one row per trace entry; rec.events is still the columnar table
    rec.timeline(by="category")    # bytes per category after each entry
    rec.findings()                 # peak, spikes, leaks, fragmentation, OOM, advice
    rec.report()                   # the dict `tracekit report --json` prints
    rec.query("SELECT category, sum(size) FROM allocations GROUP BY 1")

In a notebook the object shows the report with a picture of the stacked
timeline.
"""
from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any, Callable

from .model import Events, Trace

if TYPE_CHECKING:
    import pandas as pd

    from .analysis.window import Window



class EventsTable(Events):
    """The columnar events table; calling it gives the events as a DataFrame."""

    _owner: "weakref.ref[Recording]"

    def __call__(self) -> pd.DataFrame:
        from .analysis.tables import events_frame

        owner = self._owner()
        if owner is None:
            raise ReferenceError("the Recording these events belong to is gone")
        return events_frame(owner)


class Recording(Trace):
    """A memory file as tracekit opened it (a `Trace`), with DataFrames and the report."""

    @classmethod
    def of(cls, trace: Trace) -> "Recording":
        if isinstance(trace, cls):
            return trace
        fields = {name: getattr(trace, name) for name in Trace.__dataclass_fields__}
        rec = cls(**fields)
        rec.events = EventsTable(**{name: getattr(trace.events, name) for name in Events.__dataclass_fields__})
        rec.events._owner = weakref.ref(rec)
        return rec

    def allocations(self, rules: str | os.PathLike[str] | None = None) -> pd.DataFrame:
        """One row per allocation lifetime (pandas DataFrame)."""
        from .analysis.tables import allocations_frame

        return allocations_frame(self, rules=rules)

    def timeline(self, by: str = "category", device: int | None = None, max_points: int | None = None,
                 rules: str | os.PathLike[str] | None = None) -> pd.DataFrame:
        """Bytes per category after each entry (or `max_points` of them, peaks kept)."""
        from .analysis.tables import timeline_frame

        return timeline_frame(self, by=by, device=device, max_points=max_points, rules=rules)

    def report(self, rules: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """What `tracekit report --json` prints (sizes in bytes); computed once per rules file."""
        from .analysis.report import build_report

        cache = self.__dict__.setdefault("_reports", {})
        key = str(rules) if rules is not None else None
        if key not in cache:
            cache[key] = build_report(self, rules=rules)
        return cache[key]

    def findings(self, rules: str | os.PathLike[str] | None = None) -> pd.DataFrame:
        """The report's findings as a DataFrame: kind, device, bytes, summary, where, frames, ..."""
        import pandas as pd

        from .analysis.frames import where

        rows = [dict(f, where=f.get("where") or where(f.get("frames") or [])) for f in self.report(rules)["findings"]]
        head = ["kind", "device", "bytes", "summary", "where"]
        frame = pd.DataFrame(rows)
        if frame.empty:
            return pd.DataFrame({c: [] for c in head})
        return frame[head + [c for c in frame.columns if c not in head]]

    def summary(self, rules: str | os.PathLike[str] | None = None) -> str:
        """The text of `tracekit report`."""
        from .render import reporter

        return reporter("report", "text").render(self.report(rules), trace=self)

    def query(self, sql: str) -> pd.DataFrame:
        """Run SQL over the tables `allocations`, `events` and `timeline` (DuckDB if installed, else SQLite)."""
        from .analysis.sql import query

        return query(self, sql)

    def __repr__(self) -> str:
        devs = ", ".join(self.device_label(d) for d in self.devices) or "no devices"
        return f"<tracekit.Recording {self.path!r}: {self.format}, {len(self.events):,} entries, {devs}>"

    def _repr_markdown_(self) -> str:
        return "```\n" + self.summary() + "```\n"

    def _repr_html_(self) -> str:
        from .integrations.notebook_view import summary_html

        return summary_html(self)


def load(path: str | os.PathLike[str], progress: Callable[[float, str], None] | None = None, use_cache: bool = True,
         window: Window | None = None, write_behind: bool = False) -> Recording:
    """Open a snapshot or profiler trace (see `tracekit.io.load` for the options)."""
    from .io import load as _load

    return Recording.of(_load(path, progress=progress, use_cache=use_cache, window=window, write_behind=write_behind))
