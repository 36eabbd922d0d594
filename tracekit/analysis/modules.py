"""Memory per `nn.Module`: what each module's forward and backward hold at the peak and at most.

Our recorder writes on each allocation the module that ran (`module`; for a
backward allocation, the module whose forward op made its autograd node,
record/origins.py). Here allocations group by module and by pass (forward:
made while the module's forward ran; backward: made by the backward of its
forward ops). Repeated layers (``layers.0.mlp`` … ``layers.31.mlp``) are
also summarised as one pattern (``layers.*.mlp``). Files without the field
have no module table (None).
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np

from ..model import Trace, unique_ids
from .replay import DeviceReplay
from .sites import allocation_sites

try:  # the walk of the entries (analysis/allocator/_replay.c), when it is built
    from .allocator._replay import group_peaks as _peaks_compiled
except ImportError:  # pragma: no cover - no C compiler where it was installed
    _peaks_compiled = None  # type: ignore[assignment]

_INDEX = re.compile(r"(?<![^.])\d+(?=\.|$)")
_BRACKET = re.compile(r"\[(\d+|\*)\]")


def recorded_modules(trace: Trace, rep: DeviceReplay) -> np.ndarray:
    """The module path our recorder wrote on each allocation (object array, None where none)."""
    mod = allocation_sites(trace, rep).module
    out = np.full(len(mod), None, dtype=object)
    ids = np.unique(mod[mod > 0])
    if len(ids):
        names = np.array([trace.strings[int(i)] for i in ids], dtype=object)
        has = mod > 0
        out[has] = names[np.searchsorted(ids, mod[has])]
    return out


CHUNK = 1 << 18  # entries read back at a time by group_peaks


GROUP_ROWS = 1 << 19  # allocations whose events group_peaks sorts at a time (whole groups: a bigger one alone)


def group_peaks(group: np.ndarray, al, n_groups: int) -> np.ndarray:
    """The most bytes each group held live at once (allocations' alloc/free entry indices). Each entry is at most
    one change, so one walk of the entries in order (_replay.group_peaks) keeps every group's running sum and
    its most, without a sort; the sort below where it is not built or gives up (two changes at one entry, or
    allocations not in order of their first entry: a free goes before an alloc at one entry there)."""
    if _peaks_compiled is not None and group.dtype.kind == "i":
        a, f, size = (np.ascontiguousarray(c, np.int64) for c in (al.alloc_index, al.free_index, al.size))
        got = _peaks_compiled(a, f, size, np.ascontiguousarray(group), n_groups)
        if got is not None:
            return np.frombuffer(got, np.int64)
    return _sorted_group_peaks(group, al, n_groups)


def _sorted_group_peaks(group: np.ndarray, al, n_groups: int) -> np.ndarray:
    """group_peaks by a sort of the changes by group, then entry. Groups are independent: they are taken a few
    at a time, about GROUP_ROWS allocations together, so that the sort's temporaries stay small on a 10M-entry
    trace."""
    out = np.zeros(n_groups, np.int64)
    rows = _rows_of(group >= 0)
    if not len(rows):
        return out
    g = group[rows]
    counts = np.bincount(g, minlength=n_groups)
    bounds, acc = [0], 0
    for k, c in enumerate(counts.tolist()):
        if acc and acc + c > GROUP_ROWS:
            bounds.append(k)
            acc = 0
        acc += c
    bounds.append(n_groups)
    if len(bounds) == 2:
        del g  # one call takes every row: not held under its own
        _group_peaks(group, rows, al, out, counts)
        return out
    for g0, g1 in zip(bounds[:-1], bounds[1:]):
        _group_peaks(group, rows[(g >= g0) & (g < g1)], al, out, counts)
    return out


def _rows_of(mask: np.ndarray) -> np.ndarray:
    """np.flatnonzero(mask), in int32 below 2**31 rows, found a chunk at a time (no int64 per row beside it)."""
    if len(mask) >= 2**31:
        return np.flatnonzero(mask)
    out = np.empty(int(np.count_nonzero(mask)), np.int32)
    at = 0
    for lo in range(0, len(mask), CHUNK):
        nz = np.flatnonzero(mask[lo:lo + CHUNK])
        out[at:at + len(nz)] = nz + lo
        at += len(nz)
    return out


def _group_peaks(group: np.ndarray, rows: np.ndarray, al, out: np.ndarray, counts: np.ndarray) -> None:
    """group_peaks of the groups of `rows` (all of each group's allocations: `counts` per group), into `out`."""
    if not len(rows):
        return
    # one sort key per event: group, then entry index, a free before an allocation at the same index; built
    # in place and read back a chunk at a time, so that a 10M-entry trace's temporaries stay few
    r = len(rows)
    key = np.empty(2 * r, np.int64)
    born, freed = key[:r], key[r:]
    np.take(al.alloc_index, rows, out=born, mode="clip")  # into the keys (rows are in range: "clip", unbuffered)
    born += 1  # made before the trace (-1): 0, first
    np.take(al.free_index, rows, out=freed, mode="clip")
    freed += 1
    end = int(max(born.max(), freed.max())) + 1
    freed[freed <= 0] = end  # never freed: after every entry
    span = 2 * (end + 1)
    born *= 2
    born += 1
    freed *= 2
    gr = group[rows]
    g0 = int(gr.min())  # the groups here from 0: the keys stay small
    bits = (2 * r - 1).bit_length()
    gmax = int(gr.max()) - g0
    if (gmax + 1) * span < 1 << (62 - bits):
        # the event's number in the key's low bits: the keys are distinct, so an in-place sort orders them as
        # a stable argsort of the keys alone would, without the argsort's index array and its buffer; the
        # groups and the numbers go in a chunk at a time (no int64 per event beside the keys)
        for lo in range(0, r, CHUNK):
            gk = gr[lo:lo + CHUNK].astype(np.int64)
            gk -= g0
            gk *= span
            born[lo:lo + CHUNK] += gk
            freed[lo:lo + CHUNK] += gk
        del born, freed, gr
        key <<= bits
        for lo in range(0, 2 * r, CHUNK):
            key[lo:lo + CHUNK] |= np.arange(lo, min(lo + CHUNK, 2 * r), dtype=np.int64)
        key.sort()
        mask = (1 << bits) - 1
        for lo in range(0, 2 * r, CHUNK):
            k = key[lo:lo + CHUNK]
            o = k & mask
            d = al.size[rows[o % r]].astype(np.int64, copy=False)  # sizes read a chunk at a time, not copied out
            d[o >= r] *= -1  # the free of an allocation: its size off
            key[lo:lo + CHUNK] = d  # each chunk of the keys is read, then overwritten
        del k, o, d
        # sorted by group first, each group's events are one run: two per allocation
        present = g0 + np.flatnonzero(counts[g0:g0 + gmax + 1])
        _peaks_by_run(key, present, 2 * counts[present], out)
        return
    g = gr.astype(np.int64)
    del gr
    g *= span
    born += g
    freed += g
    size = al.size[rows].astype(np.int64)
    del born, freed, g, rows
    order = np.argsort(key, kind="stable")
    grp = np.empty(2 * r, np.int32 if len(out) < 2**31 else np.int64)  # group ids
    live = order = order.astype(np.int64, copy=False)  # each chunk of the order is read, then overwritten
    for lo in range(0, 2 * r, CHUNK):
        o = order[lo:lo + CHUNK]
        grp[lo:lo + CHUNK] = key[o] // span
        d = size[o % r]
        d[o >= r] *= -1  # the free of an allocation: its size off
        live[lo:lo + CHUNK] = d
    del key, order, size, o, d
    _peaks_of(live, grp, out)


def _peaks_by_run(live: np.ndarray, groups: np.ndarray, lengths: np.ndarray, out: np.ndarray) -> None:
    """`live`: each event's change of bytes, one run of `lengths[k]` events per group `groups[k]`, each in
    entry order; into `out`, each group's most bytes after any of its events (`live` is overwritten)."""
    np.cumsum(live, out=live)
    starts = np.r_[0, np.cumsum(lengths)[:-1]]
    base = live[starts[1:] - 1]  # each group's start, from the running sum before any is taken off (a copy)
    for s, e, b in zip(starts[1:].tolist(), (starts[1:] + lengths[1:]).tolist(), base.tolist()):
        live[s:e] -= b  # in place, a group at a time
    out[groups] = np.maximum.reduceat(live, starts)


def _peaks_of(live: np.ndarray, grp: np.ndarray, out: np.ndarray) -> None:
    """`live`: each event's change of bytes, sorted by group then entry (`grp`: its group); into `out`, each
    group's most bytes after any of its events (`live` is overwritten)."""
    np.cumsum(live, out=live)
    starts = np.flatnonzero(np.r_[True, grp[1:] != grp[:-1]])
    base = np.r_[0, live[starts[1:] - 1]]
    live -= np.repeat(base, np.diff(np.r_[starts, len(grp)]))
    out[grp[starts]] = np.maximum.reduceat(live, starts)


def allocation_module_ids(trace: Trace, rep: DeviceReplay):
    """(module id per allocation (0: none), made by a backward pass, source, class chain ids or None, names).

    `names[id]` is the text of an id. Our recorder's modules when the file has them ("recorder": ids into
    the trace's strings), else the modules found from the stacks ("stacks": analysis/modtree.py), else all
    zeros ("none")."""
    sites = allocation_sites(trace, rep)
    if (sites.module > 0).any():
        return _no_workspaces(trace, rep, sites.module), sites.forward, "recorder", None, trace.strings
    from .libraries import allocation_libraries
    from .modtree import allocation_modules

    am = allocation_modules(trace, rep.device)
    if not (am.module > 0).any():
        return am.module, np.zeros(len(am.module), bool), "none", None, am.names
    return (_no_workspaces(trace, rep, am.module), allocation_libraries(trace, rep.device).backward, "stacks",
            am.classes, am.names)


def _no_workspaces(trace: Trace, rep: DeviceReplay, module: np.ndarray) -> np.ndarray:
    """`module` with the cuBLAS workspaces (category `workspace`, categories.py) in no module: cuBLAS makes one
    per thread at the first matrix multiply, which names whatever module ran it (a rotary embedding, the first
    linear), but it serves every module after it."""
    ws = workspace_mask(trace, rep)
    if not ws.any() or len(ws) != len(module):
        return module
    out = np.array(module, copy=True)
    out[ws] = 0
    return out


def workspace_mask(trace: Trace, rep: DeviceReplay) -> np.ndarray:
    """The allocations that are cuBLAS workspaces (left out of the module table: no module holds them)."""
    from .categories import WORKSPACE, categorize

    return categorize(trace)[rep.device].labels == WORKSPACE


def module_table(trace: Trace, rep: DeviceReplay, limit: int = 15) -> dict | None:
    """{"rows": per module and pass, largest at the peak first; "layers": repeated layers; "source": where the
    modules come from ("recorder" or "stacks")}; None without modules."""
    al = rep.allocations
    module_ids, backward, source, classes, names = allocation_module_ids(trace, rep)
    if not len(al) or not (module_ids > 0).any():
        return None
    made = (al.alloc_index >= 0) & ~workspace_mask(trace, rep)  # made in the trace; module 0: outside any
    uniq, group = _module_groups(module_ids, backward, made)
    del made, module_ids, backward  # the groups say it all from here
    n = len(uniq)
    at_peak, total, count = _group_sums(group, al, rep.peak_index, n)
    most = group_peaks(group, al, n)
    rows: list[dict[str, Any]] = [{"module": names[int(u // 2)] if u >= 2 else "(outside any module)", "pass": "backward" if u % 2 else "forward",
             "bytes_at_peak": int(at_peak[k]), "peak_bytes": int(most[k]),
             "allocated_bytes": int(total[k]), "count": int(count[k])} for k, u in enumerate(uniq.tolist())]
    if classes is not None:  # the class chain of each module found from the stacks, and how it was found
        from .modtree import HOWS, allocation_modules

        how = allocation_modules(trace, rep.device).how
        first = _first_rows(group, n)
        for k, row in enumerate(rows):
            r = first.get(k)
            row["classes"] = names[int(classes[r])] if r is not None and classes[r] > 0 else None
            row["how"] = HOWS[int(how[r])] if r is not None else None
    rows.sort(key=lambda r: (-r["bytes_at_peak"], -r["peak_bytes"], r["module"], r["pass"]))
    return {"rows": rows[:limit], "modules": len(rows), "layers": _layers(rows), "source": source}


def _module_groups(module_ids: np.ndarray, backward: np.ndarray, made: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct keys module * 2 + backward of the allocations `made`, sorted; each allocation's place among
    them, -1 where not made): unique_ids' result, made a chunk of allocations at a time through a table over the
    keys' range (module ids are few and small), so no int64 per allocation is held beside the groups."""
    top = int(module_ids.max()) if len(module_ids) else 0
    if top >= 1 << 24 or int(module_ids.min(initial=0)) < 0:
        key = module_ids[made].astype(np.int64)
        key *= 2
        key += backward[made]
        uniq, inv = unique_ids(key, return_inverse=True)
        del key
        group = np.full(len(made), -1, np.int32 if len(uniq) < 2**31 else np.int64)
        group[made] = inv
        return uniq, group
    def keys(lo):  # (which of a chunk's allocations were made, their keys)
        m = made[lo:lo + CHUNK]
        return m, module_ids[lo:lo + CHUNK][m].astype(np.int64) * 2 + backward[lo:lo + CHUNK][m]

    present = np.zeros(2 * top + 2, bool)
    for lo in range(0, len(made), CHUNK):
        present[keys(lo)[1]] = True
    rank = (np.cumsum(present) - 1).astype(np.int32)
    group = np.full(len(made), -1, np.int32)
    for lo in range(0, len(made), CHUNK):
        m, k = keys(lo)
        group[lo:lo + CHUNK][m] = rank[k]
    return np.flatnonzero(present), group


def _group_sums(group: np.ndarray, al, peak: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per group: (bytes live just after entry `peak`, bytes allocated, allocations), a chunk of allocations at
    a time (the byte sums as float64, as np.bincount's weights make them: exact below 2**53 each)."""
    at_peak, total, count = np.zeros(n), np.zeros(n), np.zeros(n, np.int64)
    for lo in range(0, len(group), CHUNK):
        g, size = group[lo:lo + CHUNK], al.size[lo:lo + CHUNK]
        a, f = al.alloc_index[lo:lo + CHUNK], al.free_index[lo:lo + CHUNK]
        grouped = g >= 0
        live = grouped & (a <= peak) & ((f == -1) | (f > peak))  # Allocations.live_at, of the chunk
        at_peak += np.bincount(g[live], weights=size[live], minlength=n)
        total += np.bincount(g[grouped], weights=size[grouped], minlength=n)
        count += np.bincount(g[grouped], minlength=n)
    return at_peak, total, count


def _first_rows(group: np.ndarray, n: int) -> dict:
    """{group: its first allocation} over the allocations in a group (`group` >= 0), a chunk at a time."""
    first = np.full(n, -1, np.int64)
    for lo in range(0, len(group), CHUNK):
        g = group[lo:lo + CHUNK]
        pos = np.flatnonzero(g >= 0)
        gid, at = unique_ids(g[pos], return_index=True)
        new = first[gid] < 0
        first[gid[new]] = lo + pos[at[new]]
    seen = np.flatnonzero(first >= 0)
    return dict(zip(seen.tolist(), first[seen].tolist()))


def _layers(rows: list[dict]) -> list[dict]:
    """Rows of repeated layers folded into a pattern: how many, and their least/most bytes at the peak."""
    groups: dict = {}
    for r in rows:
        pattern = _INDEX.sub("*", r["module"])
        if pattern != r["module"]:
            groups.setdefault((pattern, r["pass"]), []).append(r)
    out = []
    for (pattern, kind), members in groups.items():
        if len(members) < 2:
            continue
        at_peak = [m["bytes_at_peak"] for m in members]
        peaks = [m["peak_bytes"] for m in members]
        row = {"pattern": pattern, "pass": kind, "layers": len(members),
               "bytes_at_peak_min": min(at_peak), "bytes_at_peak_max": max(at_peak),
               "bytes_at_peak_total": sum(at_peak), "peak_bytes_max": max(peaks)}
        cls = next((m.get("classes") for m in members if m.get("classes")), None)
        if cls:  # Qwen2ForCausalLM > Qwen2Model > Qwen2DecoderLayer ×4 > Qwen2Attention
            row["classes"] = _BRACKET.sub(lambda _: f" ×{len(members)}", cls, count=1)
            row["classes"] = _BRACKET.sub("", row["classes"])
        out.append(row)
    out.sort(key=lambda r: -r["bytes_at_peak_total"])
    return out


def add_modules(trace: Trace, devices: list[dict], reps) -> None:
    """Put each device's module table under "modules" in its report summary (None without modules)."""
    for d in devices:
        d["modules"] = module_table(trace, reps[d["device"]])


def allocation_module_names(trace: Trace, rep: DeviceReplay) -> tuple[np.ndarray, np.ndarray]:
    """(strings, ids): every allocation's module ("" where none; a backward one as "… (backward)"), as an
    index into unique strings, from our recorder's tags or else from the stacks (analysis/modtree.py)."""
    module_ids, backward, _, _, names = allocation_module_ids(trace, rep)
    key = module_ids.astype(np.int64) * 2 + backward.astype(np.int64)
    uniq, inv = unique_ids(key, return_inverse=True)
    strings = np.empty(len(uniq), dtype=object)
    for k, u in enumerate(uniq.tolist()):
        name = names[u // 2] if u >= 2 else ""
        strings[k] = f"{name} (backward)" if name and u % 2 else name
    return strings, inv.reshape(-1).astype(np.int32)
