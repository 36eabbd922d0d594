"""tracekit.load(path): DataFrames that add up to the report, SQL over them, and the allocations export."""
import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

import tracekit
from tracekit.analysis.replay import replay
from tracekit.analysis.sql import query
from tracekit.io.unpickle import restricted_load

from .conftest import SAMPLES, fixture
from .oracle import naive_replay

FILES = [SAMPLES / "gpt_adamw.pickle", fixture("snapshot_newest_format_windows_paths.pickle"),
         fixture("snapshot_cpp_frames_adamw_full_step.pickle")]


def _live_after(frame, index):
    born = frame.alloc_entry.fillna(-1) <= index
    alive = frame.free_entry.isna() | (frame.free_entry.fillna(-1) > index)
    return frame[born & alive]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_allocations_add_up_to_the_report_and_an_independent_replay(path):
    rec = tracekit.load(path)
    with open(path, "rb") as f:
        naive = naive_replay(restricted_load(f))
    report = rec.report()
    (d,) = report["devices"]
    al = rec.allocations()
    assert list(al.columns[:8]) == ["device", "device_label", "address", "size", "requested_size", "category",
                                    "how", "reason"]
    at_peak = _live_after(al, d["peak_event_index"])
    assert int(at_peak["size"].sum()) == naive["peak"] == d["peak_allocated_bytes"]
    by_cat = at_peak.groupby("category", observed=True)["size"].sum()
    assert {k: int(v) for k, v in by_cat.items() if v} == {k: v for k, v in d["categories_at_peak"].items() if v}
    assert int(al[al.free_entry.isna()]["size"].sum()) == naive["final"] == d["final_allocated_bytes"]
    assert int(al[al.alloc_entry.isna()]["size"].sum()) == naive["start"] == d["allocated_before_trace_bytes"]
    assert set(al["how"].dropna()) <= {"tag", "rule", "inferred"} and al["reason"].notna().all()
    # the alloc entry's phase is the phase the events table gives that entry
    ev = rec.events()
    assert len(ev) == len(rec.events) and int(ev["allocated"].max()) == naive["peak"]
    traced = al[al.alloc_entry.notna()]
    phase_of = ev.set_index("entry")["phase"]
    expected = phase_of.loc[traced["alloc_entry"].astype(int)].astype(str).values
    assert (traced["phase"].astype(str).values == expected).all()


def test_timeline_by_category_sums_to_allocated():
    rec = tracekit.load(SAMPLES / "gpt_adamw.pickle")
    tl = rec.timeline(by="category")
    (d,) = rec.report()["devices"]
    cats = [c for c in tl.columns if c not in ("device", "entry", "time_us", "allocated", "reserved")]
    assert (tl[cats].sum(axis=1) == tl["allocated"]).all()
    row = tl[tl.entry == d["peak_event_index"]].iloc[0]
    assert {c: int(row[c]) for c in cats if row[c]} == {k: v for k, v in d["categories_at_peak"].items() if v}
    assert len(rec.timeline(max_points=100)) <= 100
    with pytest.raises(ValueError):
        rec.timeline(by="phase")


def test_recording_is_still_a_trace():
    rec = tracekit.load(SAMPLES / "logits_spike.pickle")
    from tracekit.model import Trace

    assert isinstance(rec, Trace)
    assert len(rec.events.action) == len(rec.events) and replay(rec)[0].peak_allocated > 0
    assert "logits_spike.pickle" in repr(rec) and "entries" in repr(rec)
    f = rec.findings()
    assert list(f.columns[:5]) == ["kind", "device", "bytes", "summary", "where"]
    assert (f.kind == "peak").sum() == 1 and "peak allocated" in rec._repr_markdown_()


def test_tensor_and_module_from_the_recorders_tags():
    al = tracekit.load(SAMPLES / "gpt_adamw.pickle").allocations()
    grads = al[al.tensor.fillna("").str.endswith(".grad")]
    assert len(grads) and (grads.category == "gradient").all()
    row = grads.iloc[0]
    assert row.module == row.tensor[: -len(".grad")].rsplit(".", 1)[0]
    state = al[al.tensor.fillna("").str.endswith(".exp_avg")]
    assert len(state) and (state.category == "optimizer_state").all()
    assert (state.module == state.tensor.str.rsplit(".", n=2).str[0]).all()


@pytest.mark.parametrize("engine", ["sqlite", "duckdb"])
def test_sql_over_the_tables(engine):
    if engine == "duckdb":
        pytest.importorskip("duckdb")
    rec = tracekit.load(SAMPLES / "gpt_adamw.pickle")
    (d,) = rec.report()["devices"]
    got = query(rec, "SELECT category, SUM(size) AS bytes FROM allocations WHERE free_entry IS NULL "
                     "GROUP BY category ORDER BY category", engine=engine)
    at_end = {k: v for k, v in d["categories_at_end"].items() if v}
    assert {r.category: int(r.bytes) for r in got.itertuples()} == at_end
    peak = query(rec, "SELECT MAX(allocated) AS m FROM events", engine=engine)
    assert int(peak.m[0]) == d["peak_allocated_bytes"]
    joined = query(rec, "SELECT a.category, COUNT(*) AS n FROM allocations a JOIN events e "
                        "ON a.alloc_entry = e.entry AND a.device = e.device WHERE e.action = 'alloc' "
                        "GROUP BY 1", engine=engine)
    al = rec.allocations()
    assert int(joined.n.sum()) == int(al.alloc_entry.notna().sum())


def run(*args):
    return subprocess.run([sys.executable, "-m", "tracekit.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def test_query_command():
    r = run("query", SAMPLES / "gpt_adamw.pickle", "SELECT COUNT(*) AS n, SUM(size) AS s FROM allocations",
            "--format", "json")
    assert r.returncode == 0, r.stderr
    al = tracekit.load(SAMPLES / "gpt_adamw.pickle").allocations()
    assert json.loads(r.stdout) == [{"n": len(al), "s": int(al["size"].sum())}]
    for sql, says in [("SELEC * FROM allocations", "SQL error"), ("SELECT 1", "names none of the tables"),
                      ("SELECT nope FROM allocations", "SQL error")]:
        r = run("query", SAMPLES / "gpt_adamw.pickle", sql)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (sql, r.stderr)


@pytest.mark.parametrize("ext", [".csv", ".parquet"])
def test_export_allocations(tmp_path, ext):
    if ext == ".parquet":
        pytest.importorskip("pyarrow")
    out = tmp_path / f"al{ext}"
    r = run("export", SAMPLES / "leak_loop.pickle", "--allocations", out)
    assert r.returncode == 0, r.stderr
    back = pd.read_csv(out) if ext == ".csv" else pd.read_parquet(out)
    al = tracekit.load(SAMPLES / "leak_loop.pickle").allocations()
    assert len(back) == len(al) and list(back.columns) == list(al.columns)
    assert int(back["size"].sum()) == int(al["size"].sum())
    assert np.array_equal(back["address"].astype("uint64").to_numpy(), al["address"].to_numpy())
