"""Two recordings side by side: did the change help, and where did the bytes move?

Built from the reports of both files (the same analyses `report` runs), per
pair of devices, every change b − a:

- the headline figures (peaks, before the trace, the end);
- categories at the peak and at the end;
- aligned by phase and iteration, not by raw time: each phase's peak
  (forward, backward, optimizer step, between steps) with its categories,
  and the n-th recorded iteration of one file against the n-th of the other
  (so a run recorded after a warm-up step lines up with one that was not);
- the bytes at the peak per allocation site (the user's line, see sites.py)
  and per module (from the recorder's tensor names: parameters, gradients,
  optimizer state), each with the category that holds most of it;
- findings added, removed and changed (matched by kind and site).

Noise: a change counts when it is at least NOISE_SHARE of the larger of the
two peaks of that device pair (and at least NOISE_FLOOR bytes). Smaller ones
are kept in the JSON with "significant": false and left out of the text.
"""
from __future__ import annotations

import numpy as np

from ..model import Trace
from .phases import when
from .replay import replay
from .report import build_report
from .sites import group_sites

FIGURES = ("peak_allocated_bytes", "peak_reserved_bytes", "allocated_before_trace_bytes",
           "final_allocated_bytes", "final_reserved_bytes")
TOP_ROWS = 10
CHANGES_WORTH_SAYING = ("spike", "leak", "fragmentation", "oom")  # advice follows the categories: not repeated
NOISE_SHARE = 0.01  # of the larger peak: a change smaller than this is noise
NOISE_FLOOR = 4096  # bytes: never call a change under this significant


def diff(a: Trace, b: Trace, rules=None) -> dict:
    """JSON-ready comparison of trace `a` (before) and `b` (after); every change is b − a."""
    ra, rb = build_report(a, rules), build_report(b, rules)
    devices = []
    for da, db in pair_devices(ra["devices"], rb["devices"]):
        noise = noise_bytes(da.get("peak_allocated_bytes"), db.get("peak_allocated_bytes"))
        ch = lambda x, y: change(x, y, noise)  # noqa: E731
        devices.append({
            "device_a": da["device"], "device_b": db["device"], "label": _label(da, db),
            "noise_bytes": noise,
            **{k: ch(da.get(k), db.get(k)) for k in FIGURES},
            # the report's headline (the allocator's counter where modelled, else requested bytes: issue 31)
            "headline_peak_bytes": ch((da.get("headline_peak") or {}).get("bytes"),
                                      (db.get("headline_peak") or {}).get("bytes")),
            # what each run needed: the peak, or after an out-of-memory error a lower bound above it (oom.py)
            "demand_bytes": ch(da.get("demand_bytes", da.get("peak_allocated_bytes")),
                               db.get("demand_bytes", db.get("peak_allocated_bytes"))),
            "demand_is_lower_bound": {"a": bool(da.get("demand_is_lower_bound")),
                                      "b": bool(db.get("demand_is_lower_bound"))},
            "peak_when": {"a": when(a, da["device"], da["peak_event_index"])[2] or None,
                          "b": when(b, db["device"], db["peak_event_index"])[2] or None},
            "categories_at_peak": changes(da.get("categories_at_peak", {}), db.get("categories_at_peak", {}), noise),
            "categories_at_end": changes(da.get("categories_at_end", {}), db.get("categories_at_end", {}), noise),
            "phases": phase_changes(da.get("phases") or [], db.get("phases") or [], noise),
            "iterations": iteration_changes(da.get("iterations") or [], db.get("iterations") or [], noise),
            "sites_at_peak": keyed_changes(peak_sites(a, da["device"]), peak_sites(b, db["device"]), noise, "site"),
            "modules_at_peak": _modules(a, b, da["device"], db["device"], noise),
        })
    return {"a": a.path, "b": b.path, "noise_share": NOISE_SHARE, "devices": devices,
            "findings": finding_changes(ra["findings"], rb["findings"], devices)}


def pair_devices(devs_a, devs_b) -> list:
    """Devices with the same number; when each file has one device, those two (e.g. cpu vs cuda:0)."""
    if len(devs_a) == 1 and len(devs_b) == 1:
        return [(devs_a[0], devs_b[0])]
    by_b = {d["device"]: d for d in devs_b}
    return [(d, by_b[d["device"]]) for d in devs_a if d["device"] in by_b]


def noise_bytes(peak_a, peak_b) -> int:
    """The smallest change worth a line: NOISE_SHARE of the larger peak, at least NOISE_FLOOR."""
    return max(NOISE_FLOOR, int(NOISE_SHARE * max(peak_a or 0, peak_b or 0)))


def change(x, y, noise=0) -> dict:
    """{a, b, change, relative, significant}; relative is change / a (None when a is 0 or unknown)."""
    if x is None or y is None:
        return {"a": x, "b": y, "change": None, "relative": None, "significant": False}
    d = y - x
    return {"a": x, "b": y, "change": d, "relative": round(d / x, 4) if x else None,
            "significant": abs(d) >= max(noise, 1)}


def changes(xs: dict, ys: dict, noise=0) -> dict:
    names = list(xs) + [k for k in ys if k not in xs]
    return {k: change(xs.get(k, 0), ys.get(k, 0), noise) for k in names}


def keyed_changes(xs: dict, ys: dict, noise: int, key: str, limit: int = TOP_ROWS) -> list:
    """Rows {key, category, a, b, change, ...} for {name: {category: bytes}} maps, significant ones, largest
    first; `category` is the one whose bytes moved most (the way the total moved)."""
    rows = []
    for name in list(xs) + [k for k in ys if k not in xs]:
        ca, cb = xs.get(name, {}), ys.get(name, {})
        c = change(sum(ca.values()), sum(cb.values()), noise)
        if c["significant"]:
            moved = {k: cb.get(k, 0) - ca.get(k, 0) for k in sorted(set(ca) | set(cb))}
            rows.append({key: name, "category": max(moved, key=lambda k: moved[k] * (1 if c["change"] > 0 else -1)),
                         **c})
    return sorted(rows, key=lambda r: (-abs(r["change"]), str(r[key])))[:limit]  # ties by name: the same every run


def peak_sites(trace: Trace, device: int) -> dict:
    """{"file:line in function" of the user's frame: {category: bytes live at the peak}}."""
    from .categories import categorize

    rep = replay(trace)[device]
    cats = categorize(trace)[device]
    out: dict = {}
    for g in group_sites(trace, rep, rep.allocations.live_at(rep.peak_index), limit=1 << 30):
        _add(out.setdefault(g["where"], {}), cats, cats.labels[g["rows"]], rep.allocations.size[g["rows"]])
    return out


def peak_modules(trace: Trace, device: int) -> dict | None:
    """{module path: {category: bytes live at the peak}} of the tensors the recorder named (parameters,
    gradients, optimizer state) and, for the rest, the module that ran when they were made (tables.tag_names);
    None when the file names none (not our recorder, or no model given)."""
    from .categories import categorize
    from .tables import tag_names

    rep = replay(trace)[device]
    _, module = tag_names(trace, rep)
    named = np.array([m is not None for m in module], bool)
    if not named.any():
        return None
    cats = categorize(trace)[device]
    live = np.flatnonzero(rep.allocations.live_at(rep.peak_index) & named)
    out: dict = {}
    for name in set(module[live].tolist()):
        rows = live[module[live] == name]
        _add(out.setdefault(name or "(the model itself)", {}), cats, cats.labels[rows], rep.allocations.size[rows])
    return out


def _add(acc: dict, cats, labels, sizes):
    by = np.bincount(labels.astype(np.int64), weights=sizes.astype(np.float64), minlength=len(cats.names))
    for k in np.flatnonzero(by).tolist():
        acc[cats.names[k]] = acc.get(cats.names[k], 0) + int(round(by[k]))


def _modules(a, b, dev_a, dev_b, noise):
    ma, mb = peak_modules(a, dev_a), peak_modules(b, dev_b)
    if ma is None and mb is None:
        return None
    return keyed_changes(ma or {}, mb or {}, noise, "module")


def phase_changes(pa: list, pb: list, noise: int) -> list:
    """Each phase's peak (over all recorded iterations) and its categories, a against b."""
    by_b = {p["phase"]: p for p in pb}
    names = [p["phase"] for p in pa] + [p["phase"] for p in pb if p["phase"] not in {q["phase"] for q in pa}]
    by_a = {p["phase"]: p for p in pa}
    out = []
    for name in sorted(names, key=lambda n: (_PHASE_ORDER.index(n) if n in _PHASE_ORDER else len(_PHASE_ORDER), n)):
        x, y = by_a.get(name, {}), by_b.get(name, {})
        out.append({"phase": name, "peak_bytes": change(x.get("peak_bytes"), y.get("peak_bytes"), noise),
                    "categories_at_peak": changes(x.get("categories_at_peak", {}), y.get("categories_at_peak", {}),
                                                  noise)})
    return out


_PHASE_ORDER = ["forward", "backward", "optimizer", "prefill", "decode", "between"]  # any other: last, by name


def iteration_changes(ia: list, ib: list, noise: int) -> list:
    """The n-th recorded iteration of a against the n-th of b: peak and end bytes."""
    return [{"iteration_a": x["iteration"], "iteration_b": y["iteration"],
             "peak_bytes": change(x["peak_bytes"], y["peak_bytes"], noise),
             "end_bytes": change(x["end_bytes"], y["end_bytes"], noise),
             "categories_at_end": changes(x.get("categories_at_end", {}), y.get("categories_at_end", {}), noise)}
            for x, y in zip(ia, ib)]


def finding_changes(fa: list, fb: list, devices: list) -> dict:
    """Findings (other than the peak) of b that a lacks (added), of a that b lacks (removed), and in both
    (changed when their bytes moved beyond noise). Matched by device pair, kind and site or technique."""
    pairs = {d["device_a"]: (d["device_b"], d["noise_bytes"]) for d in devices}
    noise_of_b = {b: n for b, n in pairs.values()}
    keyed_a = _keyed([f for f in fa if f["device"] in pairs], lambda f: pairs[f["device"]][0])
    keyed_b = _keyed([f for f in fb if f["device"] in noise_of_b], lambda f: f["device"])
    added = [_brief(f) for k, f in keyed_b.items() if k not in keyed_a]
    removed = [_brief(f) for k, f in keyed_a.items() if k not in keyed_b]
    changed = []
    for k, f in keyed_b.items():
        if k in keyed_a:
            c = change(keyed_a[k]["bytes"], f["bytes"], noise_of_b[f["device"]])
            if c["significant"] and f["kind"] in CHANGES_WORTH_SAYING:
                changed.append({**_brief(f), "bytes": c})
    return {"a": _kinds(fa), "b": _kinds(fb), "added": added, "removed": removed, "changed": changed}


def _keyed(findings, device_of) -> dict:
    out: dict = {}
    for f in findings:
        if f["kind"] == "peak":
            continue
        key = (device_of(f), f["kind"], f.get("technique") or f.get("where") or "")
        out.setdefault(key, f)  # the first (largest) of a kind at one site stands for it
    return out


def _brief(f: dict) -> dict:
    return {"kind": f["kind"], "label": f.get("label"), "bytes": f["bytes"], "where": f.get("where"),
            "summary": f["summary"]}


def _label(da, db) -> str:
    return da["label"] if da["label"] == db["label"] else f"{da['label']} vs {db['label']}"


def _kinds(findings) -> dict:
    out: dict = {}
    for f in findings:
        out[f["kind"]] = out.get(f["kind"], 0) + 1
    return out
