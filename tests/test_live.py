"""What is live at one moment by category and site (the view of a file without a timeline)."""
import collections
import os

import tracekit
from tracekit.analysis.live import has_timeline, live_by_site
from tracekit.analysis.report import build_report
from tracekit.io.unpickle import restricted_load

from .conftest import SAMPLES, fixture
from .oracle import block_addresses, naive_replay

LEGACY = "snapshot_legacy_torch20_oom_observer.pickle"


def _raw(path):
    with open(path, "rb") as f:
        return restricted_load(f)


def test_legacy_snapshot_live_blocks_by_site_match_the_raw_file():
    """A torch 2.0 snapshot with no alloc/free entries: every active block, grouped by the
    first frame outside torch in its history (computed here from the raw dict)."""
    snap = _raw(fixture(LEGACY))
    trace = tracekit.load(fixture(LEGACY))
    assert not has_timeline(trace, 0)
    want = collections.Counter()
    count = collections.Counter()
    for s in snap["segments"]:
        for _, b in block_addresses(s):
            if b["state"] == "active_allocated":
                frames = b["history"][-1].get("frames", []) if b.get("history") else []
                user = [f for f in frames if "/torch/" not in f["filename"]]
                f = user[0] if user else None
                key = (f"{os.path.basename(os.path.dirname(f['filename']))}/{os.path.basename(f['filename'])}:"
                       f"{f['line']} in {f['name']}") if f else "(no stack recorded)"
                want[key] += b["size"]
                count[key] += 1
    rows = live_by_site(trace, 0)
    assert {r["site"]: r["bytes"] for r in rows} == dict(want)
    assert {r["site"]: r["count"] for r in rows} == dict(count)
    assert sum(r["bytes"] for r in rows) == naive_replay(snap)["start"]


def test_live_at_the_end_by_category_matches_the_report_and_a_naive_replay():
    path = SAMPLES / "gpt_adamw.pickle"
    trace = tracekit.load(path)
    assert has_timeline(trace, 0)
    rows = live_by_site(trace, 0)
    by_cat = collections.Counter()
    for r in rows:
        by_cat[r["category"]] += r["bytes"]
    end = build_report(trace)["devices"][0]["categories_at_end"]
    assert {k: v for k, v in by_cat.items()} == {k: v for k, v in end.items() if v}
    assert sum(by_cat.values()) == naive_replay(_raw(path))["final"]
    for cat in by_cat:  # sites of a category are listed largest first
        sizes = [r["bytes"] for r in rows if r["category"] == cat]
        assert sizes == sorted(sizes, reverse=True)
