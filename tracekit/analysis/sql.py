"""SQL over a trace's tables: `allocations`, `events`, `timeline` (see tables.py).

DuckDB runs the query when it is installed (`pip install duckdb`: fast, and
reads the DataFrames in place); otherwise the tables the query names are
copied into an in-memory SQLite database (stdlib), which speaks the common
subset (SELECT, WHERE, GROUP BY, ORDER BY, joins, window functions).
"""
from __future__ import annotations

import re

import pandas as pd

from ..errors import TracekitError
from ..model import Trace

TABLES = ("allocations", "events", "timeline")


def tables_in(sql: str) -> list[str]:
    """The tables a query names (only those are built)."""
    return [t for t in TABLES if re.search(rf"\b{t}\b", sql, re.IGNORECASE)]


def build(trace: Trace, names, rules=None) -> dict:
    from .tables import allocations_frame, events_frame, timeline_frame

    makers = {"allocations": lambda: allocations_frame(trace, rules=rules), "events": lambda: events_frame(trace),
              "timeline": lambda: timeline_frame(trace, rules=rules)}
    return {n: makers[n]() for n in names}


def query(trace: Trace, sql: str, rules=None, engine=None) -> pd.DataFrame:
    """Run `sql` over the trace's tables; a bad query raises TracekitError with the engine's message.

    `engine`: "duckdb", "sqlite" or None (DuckDB when it is installed)."""
    names = tables_in(sql)
    if not names:
        raise TracekitError(f"the query names none of the tables {', '.join(TABLES)}")
    frames = build(trace, names, rules)
    if engine is None:
        try:
            import duckdb  # noqa: F401
            engine = "duckdb"
        except ImportError:
            engine = "sqlite"
    return _duckdb(frames, sql) if engine == "duckdb" else _sqlite(frames, sql)


def _duckdb(frames, sql):
    import duckdb

    con = duckdb.connect()
    try:
        for name, frame in frames.items():
            con.register(name, _plain(frame))
        return _integral(con.execute(sql).df())
    except duckdb.Error as e:
        raise TracekitError(f"SQL error: {str(e).splitlines()[0]}") from None
    finally:
        con.close()


def _sqlite(frames, sql):
    import sqlite3

    con = sqlite3.connect(":memory:")
    try:
        for name, frame in frames.items():
            _plain(frame, sqlite=True).to_sql(name, con, index=False)
        return pd.read_sql_query(sql, con)
    except (sqlite3.Error, pd.errors.DatabaseError) as e:
        raise TracekitError(f"SQL error: {str(e).splitlines()[0]}") from None
    finally:
        con.close()


def _integral(frame: pd.DataFrame) -> pd.DataFrame:
    """DuckDB sums integers as 128-bit and pandas gets floats: whole-number float columns back to Int64."""
    for c in frame.columns:
        col = frame[c]
        if col.dtype.kind == "f" and len(col):
            v = col.dropna()
            if len(v) and (v == v.round()).all() and (v.abs() < 2**53).all():
                frame[c] = col.astype("Int64")
    return frame


def _plain(frame: pd.DataFrame, sqlite=False) -> pd.DataFrame:
    """Categoricals as strings; for SQLite, addresses as int64 (SQLite integers are signed 64-bit)."""
    out = frame.copy()
    for c in out.columns:
        if isinstance(out[c].dtype, pd.CategoricalDtype):
            out[c] = out[c].astype(object).where(out[c].notna(), None)
        elif sqlite and out[c].dtype == "uint64":
            out[c] = out[c].astype("int64")
    return out
