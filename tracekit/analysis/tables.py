"""The trace as pandas DataFrames: allocations, events and the timeline by category.

Built from the same analyses the report uses (replay, categorize, phases,
frames), so sums over these tables are the report's figures: for example the
`size` of the allocations live just after the peak entry, grouped by
`category`, is the report's `categories_at_peak`.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..model import ACTIONS, NO_TIME, Trace
from . import phases as ph
from .categories import METHODS, TAG_CATEGORY, categorize, match_tags
from .sites import allocation_sites, allocation_where, site_info, stack_sites
from .replay import ORIGINS, replay

ALLOCATION_COLUMNS = (
    "device", "device_label", "address", "size", "requested_size", "category", "how", "reason", "tensor",
    "module", "origin", "alloc_entry", "free_entry", "alloc_time_us", "free_time_us", "phase", "iteration",
    "free_phase", "user_frame", "user_file", "user_line", "user_function",
)


def allocations_frame(trace: Trace, rules=None) -> pd.DataFrame:
    """One row per allocation lifetime, every device (columns: ALLOCATION_COLUMNS).

    `size` is the bytes the replay counts (what the report sums);
    `requested_size` the final block's requested size for allocations still
    live at the end, else the size the trace gives. `alloc_entry` /
    `free_entry` are positions in the device's trace (NA: before the trace /
    still live); times are µs, NA where the file has none. `phase` and
    `iteration` are those of the alloc entry. `tensor` and `module` come from
    the recorder's tags where one labels the allocation (a parameter, its
    gradient or optimizer state names its module). `user_frame` is the first
    frame of the user's own code in the allocation's stack.
    """
    parts = [_device_allocations(trace, d, rules) for d in trace.devices]
    if not parts:
        return pd.DataFrame({c: [] for c in ALLOCATION_COLUMNS})
    return pd.concat(parts, ignore_index=True)


def _device_allocations(trace, device, rules) -> pd.DataFrame:
    rep = replay(trace)[device]
    cats = categorize(trace, rules)[device]
    dph = ph.phases(trace)[device]
    al = rep.allocations
    m = len(al)
    a, f = al.alloc_index, al.free_index
    t = trace.events.time_us[rep.events]
    tensor, module = tag_names(trace, rep)
    ufile, uline, ufunc, uwhere = _user_frames(trace, rep)
    phase_names = np.array(ph.PHASES, dtype=object)
    return pd.DataFrame({
        "device": np.full(m, device, np.int32),
        "device_label": trace.device_label(device),
        "address": al.addr,
        "size": al.size,
        "requested_size": _requested(trace, device, al),
        "category": pd.Categorical(cats.label_names(), categories=list(cats.names)),
        "how": pd.Categorical(np.array(METHODS, dtype=object)[cats.method], categories=list(METHODS)),
        "reason": reasons(cats),
        "tensor": tensor,
        "module": module,
        "origin": pd.Categorical(np.array(ORIGINS, dtype=object)[al.origin], categories=list(ORIGINS)),
        "alloc_entry": _na(a, a >= 0),
        "free_entry": _na(f, f >= 0),
        "alloc_time_us": _na(_at(t, a), (a >= 0) & (_at(t, a) != NO_TIME)),
        "free_time_us": _na(_at(t, f), (f >= 0) & (_at(t, f) != NO_TIME)),
        "phase": pd.Categorical(np.where(a >= 0, phase_names[_at(dph.phase, a)], None), categories=list(ph.PHASES)),
        "iteration": _na(_at(dph.iteration, a), (a >= 0) & (_at(dph.iteration, a) >= 0)),
        "free_phase": pd.Categorical(np.where(f >= 0, phase_names[_at(dph.phase, f)], None),
                                     categories=list(ph.PHASES)),
        "user_frame": uwhere, "user_file": ufile, "user_line": uline, "user_function": ufunc,
    }, columns=list(ALLOCATION_COLUMNS))


def reasons(cats) -> np.ndarray:
    """Why each allocation has its category: the categorizer's own reason where it gives one,
    else how it was decided (the one place the `reason` column comes from)."""
    if hasattr(cats, "reason_names"):
        return np.asarray(cats.reason_names(), dtype=object)
    text = np.array(["tagged by the recorder", "a user rule", "inferred from phases, lifetimes and frames"],
                    dtype=object)
    return text[cats.method]


def tag_names(trace: Trace, rep) -> tuple[np.ndarray, np.ndarray]:
    """(tensor, module) per allocation from the recorder's tags; None where no tag applies.

    A parameter `blocks.0.qkv.weight`, its gradient `blocks.0.qkv.weight.grad`
    and its state `blocks.0.qkv.weight.exp_avg` all name module `blocks.0.qkv`
    ("" is the model itself). Untagged allocations take the module our recorder
    wrote on them (`module`: the one that ran; see analysis/modules.py)."""
    tensor, module = _tag_names(trace, rep)
    from .modules import recorded_modules

    recorded = recorded_modules(trace, rep)
    fill = (module == None) & (recorded != None)  # noqa: E711 (object arrays)
    module[fill] = recorded[fill]
    if not fill.any():  # no module tags in the file: the modules found from the stacks (analysis/modtree.py)
        from .modules import allocation_module_ids

        ids, _, source, _, names = allocation_module_ids(trace, rep)
        if source == "stacks":
            found = np.array(list(names), dtype=object)[ids]
            fill = (module == None) & (ids > 0)  # noqa: E711
            module[fill] = found[fill]
    return tensor, module


def _tag_names(trace: Trace, rep) -> tuple[np.ndarray, np.ndarray]:
    m = len(rep.allocations)
    tensor, module = np.full(m, None, dtype=object), np.full(m, None, dtype=object)
    tags = [t for t in (trace.recorder or {}).get("tags") or []
            if isinstance(t, dict) and t.get("device", 0) == rep.device and t.get("kind") in TAG_CATEGORY
            and isinstance(t.get("name"), str)]
    if not tags or not m:
        return tensor, module
    rows = match_tags(trace, rep, tags)
    order = {"parameter": 0, "buffer": 0, "optimizer_state": 1, "gradient": 2, "input": 3, "activation": 4}
    best: dict = {}
    for row, tag in zip(rows.tolist(), tags):
        if row >= 0 and (row not in best or order[tag["kind"]] < order[best[row]["kind"]]):
            best[row] = tag
    for row, tag in best.items():
        tensor[row] = tag["name"]
        module[row] = _module_of(tag["kind"], tag["name"])
    return tensor, module


def _module_of(kind, name):
    if kind == "gradient" and name.endswith(".grad"):
        name = name[:-5]
    elif kind == "optimizer_state":
        name = name.rsplit(".", 1)[0]
    elif kind not in ("parameter", "buffer"):
        return None
    return name.rsplit(".", 1)[0] if "." in name else ""


def _user_frames(trace, rep):
    """(file, line, function, site) per allocation: the user's frame as sites.py finds it (borrowed from the
    pass for backward-engine allocations); the site string is the report's own."""
    sites = allocation_sites(trace, rep)
    strings, ids = allocation_where(trace, rep)
    frame = stack_sites(trace).user_frame[sites.site_stack.astype(np.int64) + 1]
    uniq, inv = np.unique(frame, return_inverse=True)
    cols = [[], [], []]
    for fid in uniq.tolist():
        f = trace.frame(fid) if fid >= 0 else None
        for c, key in zip(cols, ("filename", "line", "name")):
            c.append(f[key] if f else None)
    file_, line, func = (np.array(c, dtype=object)[inv] for c in cols)
    return file_, pd.array(line, dtype="Int64"), func, strings[ids]


def _requested(trace, device, al):
    b = trace.blocks
    mask = b.device == device
    req = pd.array(al.size, dtype="Int64")
    if not mask.any() or not len(al):
        return req
    by_addr = dict(zip(b.addr[mask].tolist(), b.requested_size[mask].tolist()))
    live = np.flatnonzero(al.free_index < 0)
    out = al.size.copy()
    for i in live.tolist():
        r = by_addr.get(int(al.addr[i]))
        if r:
            out[i] = r
    return pd.array(out, dtype="Int64")


def _at(values, idx):
    return values[np.maximum(idx, 0)] if len(values) else np.zeros(len(idx), values.dtype)


def _na(values, valid):
    """Nullable Int64: `values` where `valid`, NA elsewhere."""
    valid = np.asarray(valid, bool)
    return pd.arrays.IntegerArray(np.where(valid, values, 0).astype(np.int64), ~valid)


def events_frame(trace: Trace) -> pd.DataFrame:
    """One row per trace entry of every device: device, entry, action, address, size, stream, time,
    phase, iteration, allocated and reserved bytes just after it, user frame, user_metadata."""
    ev = trace.events
    reps, dphs = replay(trace), ph.phases(trace)
    n = len(ev)
    allocated = np.zeros(n, np.int64)
    reserved = np.zeros(n, np.int64)
    has_reserved = np.zeros(n, bool)
    phase = np.zeros(n, np.int8)
    iteration = np.full(n, -1, np.int64)
    for d in trace.devices:
        rep, sl = reps[d], trace.device_events(d)
        allocated[sl] = rep.allocated
        if rep.reserved is not None:
            reserved[sl], has_reserved[sl] = rep.reserved, True
        phase[sl], iteration[sl] = dphs[d].phase, dphs[d].iteration
    uniq, inv = np.unique(ev.stack_id, return_inverse=True)
    uwhere = np.array([site_info(trace, int(sid))["where"] if sid >= 0 else None for sid in uniq.tolist()],
                      dtype=object)[inv]
    strings = np.array(trace.strings.items, dtype=object)
    return pd.DataFrame({
        "device": ev.device, "entry": ev.index,
        "action": pd.Categorical(np.array(ACTIONS, dtype=object)[ev.action], categories=list(ACTIONS)),
        "address": ev.addr, "size": ev.size, "stream": ev.stream,
        "time_us": _na(ev.time_us, ev.time_us != NO_TIME),
        "phase": pd.Categorical(np.array(ph.PHASES, dtype=object)[phase], categories=list(ph.PHASES)),
        "iteration": _na(iteration, iteration >= 0),
        "allocated": allocated, "reserved": _na(reserved, has_reserved),
        "user_frame": uwhere, "user_metadata": strings[ev.user_metadata],
    })


def timeline_frame(trace: Trace, by="category", device=None, max_points=None, rules=None) -> pd.DataFrame:
    """Bytes per category after each entry (or `max_points` of them, peaks kept), per device:
    device, entry, time_us, one column per category, allocated, reserved."""
    from .timeline import category_series

    if by != "category":
        raise ValueError(f"timeline(by={by!r}): only by='category' is available")
    devices = trace.devices if device is None else [device]
    parts = []
    for d in devices:
        if d not in trace.devices:
            raise ValueError(f"no device {d} in this trace (devices: {trace.devices})")
        s = category_series(trace, d, max_points=max_points, rules=rules)
        cols = {"device": np.full(len(s.index), d, np.int32), "entry": s.index,
                "time_us": _na(s.time_us, s.time_us != NO_TIME) if s.time_us is not None else pd.NA}
        cols.update({name: v for name, v in s.by_category.items()})
        cols["allocated"] = s.total
        cols["reserved"] = s.reserved if s.reserved is not None else pd.NA
        parts.append(pd.DataFrame(cols))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
