"""Snapshots that pytorch.org/memory_viz opens and renders.

What the page (torch/utils/viz/MemoryViz.js) needs, learnt from reading it:

- a pickle of protocol 2-4 made only of dicts, lists, tuples, str, int,
  float, bool and None (its own unpickler knows no other opcode: no bytes,
  no sets), integers within +-2**53 (it reads them as JavaScript numbers);
- a dict with `segments` and `device_traces`, one list per device number it
  offers (a device is offered only when its `device_traces` slot exists);
- every segment has a `blocks` list; a block that has `frames` has a
  `requested_size`; every entry other than `oom`/`snapshot` has an int
  `addr`; every `size` is an int; frames have str `filename` and `name`;
- **categories**: once any entry carries a `category`, the list of category
  names must already contain "unknown" — the page tries to add it itself
  with a typo'd name and stops with a TypeError (blank page). So entries
  that are not allocations (segment events, `snapshot`, `oom`) carry
  "unknown", the page's own name for uncategorised memory (it colours them
  so anyway); if a file has none, the first `free_requested` of an
  allocation made inside the trace carries it (the page never colours by
  that entry); else the categories are dropped.

`renderable(snapshot)` fixes a snapshot dict in place; `from_trace(trace)`
makes one from anything tracekit opens (profiler traces included).
"""
from __future__ import annotations

from ..model import ALLOC, FREE_COMPLETED, NO_TIME, Trace

UNKNOWN = "unknown"
_NOT_ALLOCATIONS = {"segment_alloc", "segment_free", "segment_map", "segment_unmap", "snapshot", "oom"}
_NO_ADDR = {"oom", "snapshot"}


def renderable(snapshot, repair_entries=True):
    """Make a snapshot (dict, or torch 2.0's bare segment list) one the page renders; in place.

    Returns the dict (a new one wrapping a bare list). `repair_entries=False`
    trusts the entries' addr, size and frames (our recorder's, PyTorch's) and
    only places the "unknown" category: about 4x faster on a million entries.
    """
    if isinstance(snapshot, list):
        snapshot = {"segments": snapshot}
    segments = snapshot.setdefault("segments", [])
    traces = snapshot.get("device_traces")
    if not isinstance(traces, list):
        traces = snapshot["device_traces"] = []
    devices = [s.get("device", 0) for s in segments if isinstance(s.get("device", 0), int)]
    while len(traces) < max(devices, default=-1) + 1:
        traces.append([])
    for seg in segments:
        blocks = seg.setdefault("blocks", [])
        for b in blocks:
            if "frames" in b:
                b.setdefault("requested_size", b.get("size", 0))
                b["frames"] = _frames(b["frames"])
        if "frames" in seg:
            seg["frames"] = _frames(seg["frames"])
    for entries in traces if repair_entries else ():
        for e in entries:
            if e.get("action") not in _NO_ADDR and not isinstance(e.get("addr"), int):
                e["addr"] = 0
            if not isinstance(e.get("size"), int):
                e["size"] = 0
            if "frames" in e:
                e["frames"] = _frames(e["frames"])
    _ensure_unknown(traces)
    return snapshot


def _frames(frames):
    if isinstance(frames, list) and all(
            isinstance(f, dict) and isinstance(f.get("filename"), str) and isinstance(f.get("name"), str)
            for f in frames):
        return frames
    if not isinstance(frames, list):
        return []
    return [{**f, "filename": str(f.get("filename", "")), "name": str(f.get("name", "")),
             "line": f.get("line", 0) if isinstance(f.get("line", 0), int) else 0}
            for f in frames if isinstance(f, dict)]


def _ensure_unknown(traces) -> None:
    """Give the file the "unknown" category the page insists on, without recolouring anything."""
    if not any("category" in e for entries in traces for e in entries):
        return
    placed = False
    for entries in traces:
        for e in entries:
            if e.get("action") in _NOT_ALLOCATIONS:
                e["category"] = UNKNOWN
                placed = True
            elif e.get("category") == UNKNOWN:
                placed = True
    if placed:
        return
    for entries in traces:
        live = set()
        for e in entries:
            act = e.get("action")
            if act == "alloc":
                live.add(e.get("addr"))
            elif act == "free_requested" and e.get("addr") in live:
                e["category"] = UNKNOWN
                return
            elif act == "free_completed":
                live.discard(e.get("addr"))
    for entries in traces:
        for e in entries:
            e.pop("category", None)


def has_categories(snapshot) -> bool:
    return isinstance(snapshot, dict) and any(
        "category" in e for entries in snapshot.get("device_traces") or [] for e in entries)


# -- profiler traces and other inputs --------------------------------------------------------------

def from_trace(trace: Trace, before=None) -> dict:
    """A snapshot dict of a Trace that has no allocator segments (profiler traces).

    Each allocation becomes its own segment (as tracekit's CPU recorder writes
    them): `segment_alloc` + `alloc`, and `free_requested` + `free_completed`
    + `segment_free`; blocks live at the end become final segments. CUDA
    devices keep their numbers; the CPU (-1 in profiler traces) takes the
    first free one. The top-level `tracekit_export` key keeps their labels and
    the source (not `tracekit`: that key means our recorder made the file). Traces without
    addresses get synthetic ones: a free closes the latest live allocation of
    its size (so the curve is right, not which tensor is which). The
    profiler's own categories (memory timelines) are kept, with its names.
    `before` ({device: bytes}) is memory live before the trace that it never
    frees (the profiler's `Total Allocated` says it exists, nothing says
    what): one block, live throughout, with no frames.
    """
    index = {d: d for d in trace.devices if d >= 0}
    free = (k for k in range(len(trace.devices) + max(index, default=0) + 1) if k not in index.values())
    index.update({d: next(free) for d in trace.devices if d < 0})
    traces: list[list]
    traces, segments, devices = [[] for _ in range(max(index.values(), default=-1) + 1)], [], []
    for d in trace.devices:
        k = index[d]
        sl = trace.device_events(d)
        has_addr = trace.meta.get("has_addresses", True)
        entries, live = _entries(trace, sl, k, has_addr)
        traces[k] = entries
        extra = int((before or {}).get(d, 0))
        if extra > 0:  # above every address the trace uses (synthetic ones stay below 2**52)
            top = 0
            if has_addr and len(entries):
                top = int(trace.events.addr[sl].max()) + int(trace.events.size[sl].max())
            live[((top >> 20) + 2) << 20 if has_addr else 1 << 52] = (extra, [], 0)
        for addr, (size, frames, stream) in sorted(live.items()):
            segments.append({"device": k, "address": addr, "total_size": size, "allocated_size": size,
                             "active_size": size, "requested_size": size, "stream": stream,
                             "segment_type": "profiler", "segment_pool_id": (0, 0), "is_expandable": False,
                             "frames": frames,
                             "blocks": [{"address": addr, "size": size, "requested_size": size,
                                         "state": "active_allocated", "frames": frames}]})
        label = trace.device_label(d)
        devices.append({"index": k, "label": label})
    return {"segments": segments, "device_traces": traces,
            "tracekit_export": {"source": trace.path, "format": trace.format, "devices": devices}}


def _entries(trace, sl, device, has_addr):
    ev = trace.events
    action, addr, size = ev.action[sl], ev.addr[sl], ev.size[sl]
    stream, time_us, stack, cat = ev.stream[sl], ev.time_us[sl], ev.stack_id[sl], ev.category[sl]
    frames_of = {}
    live = {}  # addr -> (size, frames, stream)
    by_size = {}  # size -> [synthetic addrs live], for traces without addresses
    fakes = iter(range(1 << 20, 1 << 52, 1 << 20))  # synthetic addresses, 1 MiB apart
    out = []

    for i in range(len(action)):
        act, n = int(action[i]), int(size[i])
        if act not in (ALLOC, FREE_COMPLETED):
            continue
        s = int(stack[i])
        if s not in frames_of:
            frames_of[s] = trace.stack(s) if s >= 0 else []
        base = {"size": n, "stream": int(stream[i]), "frames": frames_of[s]}
        if time_us[i] != NO_TIME:
            base["time_us"] = int(time_us[i])
        if cat[i]:
            base["category"] = trace.strings[int(cat[i])]
        if act == ALLOC:
            a = int(addr[i]) if has_addr else next(fakes)
            if not has_addr:
                by_size.setdefault(n, []).append(a)
            live[a] = (n, base["frames"], base["stream"])
            out += [{**base, "action": "segment_alloc", "addr": a}, {**base, "action": "alloc", "addr": a}]
        else:
            if has_addr:
                a = int(addr[i])
            else:
                pool = by_size.get(n)
                a = pool.pop() if pool else next(fakes)
            live.pop(a, None)
            out += [{**base, "action": "free_requested", "addr": a}, {**base, "action": "free_completed", "addr": a},
                    {**base, "action": "segment_free", "addr": a}]
    return out, live
