"""Two recordings side by side: did the change help, and where did the bytes move?

Built only from the reports of both files (the same analyses `report` runs):
per device, the peak and end figures, the categories at the peak and the
allocation sites (the user's own line) holding the most bytes at the peak.
"""
from __future__ import annotations

import numpy as np

from ..model import Trace
from .sites import group_sites
from .replay import replay
from .report import build_report

FIGURES = ("peak_allocated_bytes", "peak_reserved_bytes", "allocated_before_trace_bytes",
           "final_allocated_bytes", "final_reserved_bytes")
TOP_SITES = 10


def diff(a: Trace, b: Trace, rules=None) -> dict:
    """JSON-ready comparison of trace `a` (before) and `b` (after); every change is b − a."""
    ra, rb = build_report(a, rules), build_report(b, rules)
    devices = []
    for da, db in pair_devices(ra["devices"], rb["devices"]):
        devices.append({
            "device_a": da["device"], "device_b": db["device"], "label": _label(da, db),
            **{k: _change(da.get(k), db.get(k)) for k in FIGURES},
            "categories_at_peak": _changes(da.get("categories_at_peak", {}), db.get("categories_at_peak", {})),
            "sites_at_peak": _site_changes(peak_sites(a, da["device"]), peak_sites(b, db["device"])),
        })
    return {"a": a.path, "b": b.path, "devices": devices,
            "findings": {"a": _kinds(ra["findings"]), "b": _kinds(rb["findings"])}}


def pair_devices(devs_a, devs_b) -> list:
    """Devices with the same number; when each file has one device, those two (e.g. cpu vs cuda:0)."""
    if len(devs_a) == 1 and len(devs_b) == 1:
        return [(devs_a[0], devs_b[0])]
    by_b = {d["device"]: d for d in devs_b}
    return [(d, by_b[d["device"]]) for d in devs_a if d["device"] in by_b]


def peak_sites(trace: Trace, device: int) -> dict:
    """{"file:line in function" of the user's frame: bytes live at the peak} for one device."""
    rep = replay(trace)[device]
    out = {}
    for g in group_sites(trace, rep, rep.allocations.live_at(rep.peak_index), limit=1 << 30):
        out[g["where"]] = out.get(g["where"], 0) + g["bytes"]
    return out


def _change(x, y) -> dict:
    return {"a": x, "b": y, "change": None if x is None or y is None else y - x}


def _changes(xs: dict, ys: dict) -> dict:
    names = list(xs) + [k for k in ys if k not in xs]
    return {k: _change(xs.get(k, 0), ys.get(k, 0)) for k in names}


def _site_changes(xs: dict, ys: dict) -> list:
    rows = [{"site": k, **v} for k, v in _changes(xs, ys).items() if v["change"]]
    return sorted(rows, key=lambda r: -abs(r["change"]))[:TOP_SITES]


def _label(da, db) -> str:
    return da["label"] if da["label"] == db["label"] else f"{da['label']} vs {db['label']}"


def _kinds(findings) -> dict:
    out = {}
    for f in findings:
        out[f["kind"]] = out.get(f["kind"], 0) + 1
    return out
