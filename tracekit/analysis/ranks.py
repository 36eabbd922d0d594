"""Many ranks: a small summary of each rank's recording, one row per rank, and the imbalance.

`summarize(trace)` is the per-rank summary (what the recorder writes beside
each rank's file at the end of recording, and what `tracekit report DIR`
computes for files without one): per device the peak, when it came, the
categories at the peak and at the end, each phase's and iteration's peak, a
downsampled allocated curve, and the findings' one-line summaries.

`rank_table(summaries)` puts them side by side: the rank of each (the
recorder's metadata, else a `.rankN.` name, else the order given), its main
device's peak, and the imbalance: max/min of the peaks, and the outlier (the
rank farthest from the median peak), measured against the median of the
other ranks, with the categories that make the difference.
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np

from ..model import Trace
from .phases import when
from .diff import NOISE_SHARE
from .replay import replay
from .report import build_report

FORMAT = "tracekit-summary"
VERSION = 3  # 2: demand_bytes / demand_is_lower_bound / out_of_memory per device; 3: distributed (what the rank holds)
CURVE_POINTS = 256  # points of the allocated curve kept in a summary (envelope: the peaks survive)
OUTLIER_SHARE = 0.05  # a rank is an outlier when its peak is this far from the median peak
OUTLIER_FLOOR = 4096  # bytes
_RANK_NAME = re.compile(r"(?:^|[._-])rank[._-]?(\d+)(?=[._-]|$)", re.IGNORECASE)


def summarize(trace: Trace, rules=None) -> dict:
    """The per-rank summary of one recording (JSON-ready builtins, sizes in bytes, times in s since its start)."""
    from .timeline import envelope, time_origin

    report = build_report(trace, rules)
    reps = replay(trace)
    t0 = time_origin(trace)
    settings = (trace.recorder or {}).get("settings") or {}
    devices = []
    for d in report["devices"]:
        rep = reps[d["device"]]
        idx = envelope(rep.allocated, 0, rep.n, CURVE_POINTS) if rep.n else np.zeros(0, np.int64)
        t = trace.events.time_us[rep.events][idx] if rep.n else idx
        devices.append({
            **{k: d.get(k) for k in ("device", "label", "entries", "peak_allocated_bytes", "peak_event_index",
                                     "peak_phase", "peak_iteration", "peak_reserved_bytes", "final_allocated_bytes",
                                     "allocated_before_trace_bytes", "categories_at_peak", "categories_at_end",
                                     "demand_bytes", "demand_is_lower_bound", "out_of_memory")},
            "peak_time_s": None if d.get("peak_time_us") is None or t0 is None else (d["peak_time_us"] - t0) / 1e6,
            "peak_when": when(trace, d["device"], d["peak_event_index"])[2] or None,
            "distributed": _holds(d.get("distributed")),
            "phases": [{"phase": p["phase"], "peak_bytes": p["peak_bytes"]} for p in d.get("phases") or []],
            "iterations": [{k: i[k] for k in ("iteration", "peak_bytes", "end_bytes")}
                           for i in d.get("iterations") or []],
            "curve": {"index": idx.tolist(), "allocated": rep.allocated[idx].tolist() if rep.n else [],
                      "time_s": ([(int(x) - t0) / 1e6 for x in t.tolist()] if t0 is not None and trace.has_time
                                 else None)},
        })
    return {"format": FORMAT, "version": VERSION, "file": trace.path, "format_of_file": report["format"],
            "rank": settings.get("rank"), "world_size": settings.get("world_size"), "devices": devices,
            "findings": [{k: f.get(k) for k in ("kind", "device", "label", "bytes", "where", "summary")}
                         for f in report["findings"] if f["kind"] != "peak"]}


HOLDS_KEYS = ("strategy", "world_size", "rank", "parameter_bytes", "local_parameter_bytes", "share",
              "unsharded_units_at_peak", "prefetched_at_peak", "prefetched_bytes_at_peak", "unsharded_bytes_at_peak",
              "summary")


def _holds(d: dict | None) -> dict | None:
    """What a rank of a sharded / data-parallel job holds (analysis/distributed.rank_holds), for its summary."""
    return {k: d.get(k) for k in HOLDS_KEYS} if isinstance(d, dict) else None


def is_summary(obj) -> bool:
    """A summary this version reads, with every field the rank report uses of the right type (a file
    beside a recording is untrusted: anything else is ignored and the recording analysed instead)."""
    def num(v, none=True):
        return (v is None and none) or (isinstance(v, (int, float)) and not isinstance(v, bool))

    def sizes(d):
        return isinstance(d, dict) and all(isinstance(k, str) and num(v, False) for k, v in d.items())

    try:
        if not (isinstance(obj, dict) and obj.get("format") == FORMAT and obj.get("version") == VERSION
                and isinstance(obj.get("devices"), list) and isinstance(obj.get("findings"), list)
                and (obj.get("rank") is None or type(obj["rank"]) is int)):
            return False
        for d in obj["devices"]:
            curve = d["curve"]
            if not (isinstance(d, dict) and num(d["device"], False) and num(d["peak_allocated_bytes"])
                    and num(d["final_allocated_bytes"]) and num(d.get("peak_time_s")) and num(d.get("demand_bytes"))
                    and isinstance(d.get("demand_is_lower_bound", False), (bool, type(None)))
                    and isinstance(d["peak_when"] or "", str) and isinstance(d["label"], str)
                    and (d.get("distributed") is None or (isinstance(d["distributed"], dict)
                                                          and isinstance(d["distributed"].get("summary"), str)))
                    and sizes(d["categories_at_peak"]) and sizes(d["categories_at_end"] or {})
                    and isinstance(curve, dict) and all(isinstance(curve[k] or [], list) and
                                                        all(num(v, False) for v in curve[k] or [])
                                                        for k in ("index", "allocated", "time_s"))):
                return False
        return all(isinstance(f, dict) and isinstance(f["kind"], str) and isinstance(f["summary"], str)
                   for f in obj["findings"])
    except (KeyError, TypeError):
        return False


def rank_of_name(path: str) -> int | None:
    """N of a `.rankN.` (or `rank_N`, `-rankN-`) part of a file's name, else None."""
    name = str(path).replace("\\", "/").rsplit("/", 1)[-1]
    m = _RANK_NAME.search(name)
    return int(m.group(1)) if m else None


def main_device(summary: dict) -> dict | None:
    """The device that needed the most (a rank's GPU; the CPU when it recorded only that): its peak, or after an
    out-of-memory error what it needed at least."""
    devs = [d for d in summary.get("devices") or [] if d.get("peak_allocated_bytes") is not None]
    return max(devs, key=_need) if devs else None


def _need(d: dict) -> int:
    got = d.get("demand_bytes")
    return got if isinstance(got, int) and not isinstance(got, bool) else d["peak_allocated_bytes"]


def assign_ranks(summaries: list[dict], paths: list[str]) -> tuple[list[int], str]:
    """A rank per file: the recorder's metadata, else `.rankN.` names, else the order given
    (the first source that gives every file a distinct rank)."""
    for source, ranks in (("the recorder's metadata", [s.get("rank") for s in summaries]),
                          ("the file names", [rank_of_name(p) for p in paths])):
        if all(isinstance(r, int) for r in ranks) and len(set(ranks)) == len(ranks):
            return [r for r in ranks if isinstance(r, int)], source
    return list(range(len(paths))), "the order given"


def rank_table(summaries: list[dict], paths: list[str], with_curves: bool = False) -> dict:
    """One row per rank (sorted by rank) and the imbalance between their peaks; `with_curves`: each row
    also holds its main device's downsampled allocated curve (for the rank dashboard)."""
    ranks, source = assign_ranks(summaries, paths)
    rows: list[dict[str, Any]] = []
    for rank, s, path in zip(ranks, summaries, paths):
        dev = main_device(s) or {}
        found = [f for f in s.get("findings") or []
                 if f.get("kind") != "advice" and f.get("device") in (None, dev.get("device"))]
        kinds: dict = {}
        for f in found:
            kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
        lower = bool(dev.get("demand_is_lower_bound"))
        rows.append({"rank": rank, "file": path, "device": dev.get("label"),
                     # a rank that ran out of memory stands with what it needed at least (its demand)
                     "peak_allocated_bytes": _need(dev) if dev else None,
                     "measured_peak_bytes": dev.get("peak_allocated_bytes"),
                     "demand_is_lower_bound": lower, "peak_when": dev.get("peak_when"),
                     "peak_time_s": dev.get("peak_time_s"), "final_allocated_bytes": dev.get("final_allocated_bytes"),
                     "categories_at_peak": dev.get("categories_at_peak") or {}, "findings": kinds,
                     "holds": dev.get("distributed"),
                     "finding_summaries": [f["summary"] for f in found]})
        if with_curves:
            rows[-1]["curve"] = dev.get("curve")
    rows.sort(key=lambda r: r["rank"])
    return {"rank_source": source, "ranks": rows, "imbalance": imbalance(rows)}


def imbalance(rows: list[dict]) -> dict | None:
    """max/min of the peaks, and the rank farthest from the median peak: how far above (or below) the median
    of the other ranks it peaks, and by which categories (those that moved beyond noise, the same way)."""
    rows = [r for r in rows if r.get("peak_allocated_bytes") is not None]
    if len(rows) < 2:
        return None
    peaks = np.array([r["peak_allocated_bytes"] for r in rows], np.int64)
    median = float(np.median(peaks))
    # farthest from the median; on a tie (e.g. two ranks) the larger peak, which sets the job's memory
    k = max(range(len(rows)), key=lambda i: (abs(peaks[i] - median), peaks[i]))
    others = [r for i, r in enumerate(rows) if i != k]
    base = float(np.median([r["peak_allocated_bytes"] for r in others]))  # what the other ranks peak at
    dev = float(peaks[k]) - base
    names = sorted({c for r in rows for c in r["categories_at_peak"]})
    by_cat = []
    for c in names:
        med = float(np.median([r["categories_at_peak"].get(c, 0) for r in others]))
        delta = rows[k]["categories_at_peak"].get(c, 0) - med
        if abs(delta) >= max(OUTLIER_FLOOR, NOISE_SHARE * base) and np.sign(delta) == np.sign(dev):
            by_cat.append({"category": c, "bytes": int(round(delta)), "others_bytes": int(round(med))})
    by_cat.sort(key=lambda x: -abs(x["bytes"]))
    lo, hi = int(np.argmin(peaks)), int(np.argmax(peaks))
    if lo == hi:  # every rank peaks at the same bytes: the last rank is the "max" (never one rank for both ends)
        hi = len(rows) - 1 if lo == 0 else 0
    threshold = max(OUTLIER_FLOOR, OUTLIER_SHARE * base)
    return {
        "equal": bool(peaks[lo] == peaks[hi]), "ranks": len(rows),
        "min_bytes": int(peaks[lo]), "min_rank": rows[lo]["rank"],
        "max_bytes": int(peaks[hi]), "max_rank": rows[hi]["rank"],
        "max_over_min": round(float(peaks[hi]) / float(peaks[lo]), 4) if peaks[lo] > 0 else None,
        "median_bytes": int(round(median)),
        "outlier": {"rank": rows[k]["rank"], "peak_bytes": int(peaks[k]), "others_bytes": int(round(base)),
                    "over_others_bytes": int(round(dev)), "relative": round(dev / base, 4) if base else None,
                    "by_category": by_cat} if abs(dev) >= threshold else None,
        "threshold_share": OUTLIER_SHARE,
    }
