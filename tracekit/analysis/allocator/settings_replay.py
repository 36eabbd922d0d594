"""What the same request stream would have cost under other allocator settings.

The trace's requests (alloc, free_requested, free_completed, the request that ran out
of memory, the program's own empty_cache calls) are served by the model under a
configuration of your choosing; the allocator's own decisions (which block, when to
ask CUDA for a segment, when to give cached memory back and retry) are the model's.

Where the trace begins with memory already held (a recording started after warm-up),
the run starts either from that state as it was (`start="recorded"`, the default: the
state is rebuilt from the final segments as the report's replay rebuilds it, its segments
stay, as when the setting is changed while a program runs; the run under the recorded
settings then reproduces the recorded reserved peak) or from an empty allocator that
first allocates the blocks held then, in address order (`start="rebuilt"`: as if the
program had run under the setting from its start; the blocks then lie elsewhere than in
the file, so the baseline may differ from the recorded peak: the output says by how much).
Both runs, under the recorded settings and under yours, start the same way, so they
compare like for like.

`expandable_replay` is the one answer to "what would expandable segments save": the report's
fragmentation finding and the levers (`whatif --budget`, the advice) read it, and it is the
device row `whatif --alloc-conf expandable_segments:True` prints.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...model import (ALLOC, FREE_COMPLETED, FREE_REQUESTED, OOM, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP,
                      SEGMENT_UNMAP, Trace)
from .config import DEFAULT_TOTAL_MEMORY, NO_LIMIT, ROUND_LARGE, AllocatorConfig
from .core import Allocator, Device, OutOfMemory
from ..memo import per_trace
from .state import PENDING, initial_state, load

STARTS = ("recorded", "rebuilt")
DEFAULT_START = "recorded"  # the report's own start: the baseline reproduces the recorded peaks
EXPANDABLE = "expandable_segments:True"


@dataclass
class Run:
    """One simulated run of a device's requests."""

    config: AllocatorConfig
    peak_reserved: int
    peak_allocated: int
    peak_reserved_index: int  # entry after which reserved first reached its peak (-1: before the first)
    allocated_at_peak: int  # allocated bytes at that moment
    largest_free_at_peak: int  # the largest cached free block then
    segments_at_peak: list[tuple[int, int, int]]  # [(address, size, allocated bytes in it)] at that moment
    final_reserved: int
    device_allocs: int  # cudaMalloc calls and page mappings made during the trace
    device_frees: int
    retries: int  # times the allocator freed its cache and retried
    ooms: list[dict[str, int]]  # [{index, request_bytes}] requests that failed
    failed_request: dict | None  # the recorded out-of-memory request: {index, request_bytes, fits}
    # (action, addr, size, stream) of the segment entries, in order
    events: list[tuple[str, int, int, int]] = field(default_factory=list)
    reserved: np.ndarray | None = None  # int64 per entry (with curves=True)
    allocated: np.ndarray | None = None  # int64 per entry
    blocks: np.ndarray | None = None  # int64 per entry: the block an alloc entry got (0 for other entries)

    @property
    def fragmentation_at_peak(self) -> int:
        return self.peak_reserved - self.allocated_at_peak


def allocator_syncs(action: np.ndarray, addr, recorded: AllocatorConfig | None = None,
                    fraction=False) -> np.ndarray:
    """free_completed entries the allocator makes itself when it runs out of memory: before giving every
    cached block back it waits for the frees still in flight (a run of free_completed right before a run
    of segment_free / segment_unmap that ends in a request for memory or an oom; a free_completed right
    after its own free_requested is an ordinary free, not one of these).

    Frees whose streams finished just before a request look the same in the trace. They are told apart
    only where it matters: when the recorded settings could give memory back before that wait (garbage
    collection under a memory fraction, or max_split_size's oversize blocks), a run counts as the wait
    only if such a release comes right before it."""
    early = recorded is not None and ((fraction and recorded.garbage_collection_threshold > 0)
                                      or recorded.max_split_size != NO_LIMIT)
    n = len(action)
    out: list = []
    i = 0
    while i < n:
        if action[i] == FREE_COMPLETED:
            j = i
            while j < n and action[j] == FREE_COMPLETED:
                j += 1
            k = j
            while k < n and action[k] in (SEGMENT_FREE, SEGMENT_UNMAP):
                k += 1
            if k > j and k < n and action[k] in (SEGMENT_ALLOC, SEGMENT_MAP, OOM) and (
                    not early or (i > 0 and action[i - 1] in (SEGMENT_FREE, SEGMENT_UNMAP))):
                out.extend(m for m in range(i, j)
                           if not (m > 0 and action[m - 1] == FREE_REQUESTED and addr[m - 1] == addr[m]))
            i = j
        else:
            i += 1
    return np.asarray(out, np.int64)


def user_releases(action: np.ndarray, allocator_may_release=True) -> np.ndarray:
    """Entry indices where the program itself gave cached memory back (torch.cuda.empty_cache), the first
    entry of each run of segment_free / segment_unmap. A run followed by the allocator asking for memory
    (segment_alloc / segment_map) or failing (oom) is what its own retries look like, and is left out when
    `allocator_may_release` (the model then frees memory itself when it runs out)."""
    rel = np.isin(action, (SEGMENT_FREE, SEGMENT_UNMAP))
    through = rel | (action == FREE_COMPLETED)  # the allocator may wait for frees in flight between its releases
    out = []
    i, n = 0, len(action)
    while i < n:
        if rel[i]:
            j = i
            while j < n and through[j]:
                j += 1
            if not allocator_may_release or j >= n or action[j] not in (SEGMENT_ALLOC, SEGMENT_MAP, OOM):
                out.append(i)
            i = j
        else:
            i += 1
    return np.asarray(out, np.int64)


def replay_under_settings(trace: Trace, device: int, config: AllocatorConfig, *, recorded: AllocatorConfig,
             start: str = "rebuilt", capacity=None, memory_fraction_bytes=None, total_memory=DEFAULT_TOTAL_MEMORY,
             follow_addresses=False, curves=False) -> Run:
    """Serve the device's recorded requests with the model under `config`.

    `recorded`: the settings the file was recorded with (they decide the state at the trace's start);
    `capacity`: bytes CUDA would let this process reserve (None: no limit);
    `memory_fraction_bytes`: torch.cuda.set_per_process_memory_fraction's cap in bytes (None: not set);
    `follow_addresses`: give new segments the addresses the trace's own segment_alloc entries have, while
    their sizes agree (the run then reproduces a recording address for address)."""
    ev = trace.events
    sl = ev.device_slice(device)
    action = ev.action[sl]
    addr, size, stream = ev.addr[sl].tolist(), ev.size[sl].tolist(), ev.stream[sl].tolist()
    acts = action.tolist()
    n = len(acts)

    queue = []
    if follow_addresses:
        seg_rows = np.flatnonzero(action == SEGMENT_ALLOC).tolist()
        queue = [(size[i], stream[i], addr[i]) for i in seg_rows]

    def addresses(sz, st, small, expandable):
        if queue and not expandable and queue[0][0] == sz and queue[0][1] == st:
            return queue.pop(0)[2]
        return None

    dev = Device(capacity=capacity, total_memory=total_memory, addresses=addresses if follow_addresses else None)
    # made-up addresses start above every address the file uses, so they never meet a real one
    seg = trace.segments
    top = max([int(ev.addr[sl].max()) if n else 0] +
              [int(a) + int(z) for a, z in zip(seg.address.tolist(), seg.total_size.tolist())] + [dev._next])
    dev._next = -(-(top + (1 << 30)) // ROUND_LARGE) * ROUND_LARGE
    init = initial_state(trace, device, recorded)
    if start == "recorded":
        alloc = Allocator(config, dev, memory_fraction_bytes)
        live = load(alloc, init)
    else:
        alloc = Allocator(config, dev, memory_fraction_bytes)
        live = {}
        for h in sorted(init.held, key=lambda h: h.addr):
            try:
                held = alloc.malloc(max(h.requested, 1) if h.requested else h.size, h.stream)
            except OutOfMemory:
                continue
            if h.state == PENDING:
                alloc.free(held, completed=False)
            live[h.addr] = held
    log: list
    alloc.log = log = []
    alloc.peak_reserved = alloc.reserved
    alloc.peak_allocated = alloc.allocated

    # the file's releases are the program's (empty_cache) unless the model knows a limit that would make
    # the allocator release memory itself (then those followed by a request for memory are its own)
    limited = capacity is not None or memory_fraction_bytes is not None
    releases = set(user_releases(action, allocator_may_release=limited).tolist())
    synced = set(allocator_syncs(action, addr, recorded, memory_fraction_bytes is not None).tolist()) \
        if limited else set()
    deferred = []  # blocks whose free the allocator completed while making room for the next request
    ooms, failed = [], None
    peak_r, peak_i, at_peak_alloc = alloc.reserved, -1, alloc.allocated
    largest_at_peak = alloc.largest_free()
    segs_at_peak = _segments(alloc)
    res_curve = np.zeros(n if curves else 0, np.int64)
    alloc_curve = np.zeros(n if curves else 0, np.int64)
    block_of = np.zeros(n if curves else 0, np.int64)
    lost = set()
    for i in range(n):
        a = acts[i]
        if a == ALLOC:
            try:
                live[addr[i]] = got = alloc.malloc(size[i], stream[i])
                if curves:
                    block_of[i] = got.size
            except OutOfMemory:
                ooms.append({"index": i, "request_bytes": int(size[i])})
                lost.add(addr[i])
                live.pop(addr[i], None)
        elif a == FREE_REQUESTED:
            b = live.get(addr[i])
            if b is not None:
                alloc.free(b, completed=False)
        elif a == FREE_COMPLETED:
            b = live.pop(addr[i], None)
            if b is not None:
                if b.allocated:
                    alloc.free(b)
                elif i in synced:
                    deferred.append(b)
                else:
                    alloc.complete_free(b)
        elif i in releases:
            alloc.release_cached()
        elif a == OOM:  # the request that failed: does it fit now?
            try:
                b = alloc.malloc(size[i], stream[i])
                fits = True
                alloc.free(b)
            except OutOfMemory:
                fits = False
            if failed is None:
                failed = {"index": i, "request_bytes": int(size[i]), "fits": fits}
            if not fits:
                ooms.append({"index": i, "request_bytes": int(size[i])})
        if deferred and a in (ALLOC, OOM):
            for b in deferred:
                alloc.complete_free(b)
            deferred = []
        if alloc.reserved > peak_r:
            peak_r, peak_i, at_peak_alloc = alloc.reserved, i, alloc.allocated
            largest_at_peak = alloc.largest_free()
            segs_at_peak = _segments(alloc)
        if curves:
            res_curve[i] = alloc.reserved
            alloc_curve[i] = alloc.allocated
    return Run(config=config, peak_reserved=peak_r, peak_allocated=alloc.peak_allocated, peak_reserved_index=peak_i,
               allocated_at_peak=at_peak_alloc, largest_free_at_peak=largest_at_peak, segments_at_peak=segs_at_peak,
               final_reserved=alloc.reserved,
               device_allocs=sum(1 for e in log if e[0] in ("segment_alloc", "segment_map")),
               device_frees=sum(1 for e in log if e[0] in ("segment_free", "segment_unmap")),
               retries=alloc.retries, ooms=ooms, failed_request=failed,
               events=[e for e in log if e[0].startswith("segment_")], reserved=res_curve if curves else None,
                   allocated=alloc_curve if curves else None,
               blocks=block_of if curves else None)


def _segments(alloc: Allocator) -> list:
    return [(s["address"], s["total_size"], sum(b["size"] for b in s["blocks"] if b["state"] != "inactive"))
            for s in alloc.snapshot()]


def _run_dict(run: Run) -> dict:
    return {
        "settings": run.config.describe(),
        "peak_reserved_bytes": run.peak_reserved,
        "peak_reserved_index": run.peak_reserved_index,
        "peak_allocated_bytes": run.peak_allocated,
        "allocated_at_peak_bytes": run.allocated_at_peak,
        "fragmentation_at_peak_bytes": run.fragmentation_at_peak,
        "largest_free_block_at_peak_bytes": run.largest_free_at_peak,
        "segments_at_peak": len(run.segments_at_peak),
        "final_reserved_bytes": run.final_reserved,
        "device_allocations": run.device_allocs,
        "device_frees": run.device_frees,
        "retries": run.retries,
        "failed_requests": run.ooms[:10],
        "failed_request_count": len(run.ooms),
    }


def device_limits(trace: Trace, device: int, exact=None) -> dict:
    """What the file says about the memory this process could use on the device:
    `device_memory_bytes` (what cudaMalloc could get: at an out-of-memory entry, reserved then plus the
    free memory CUDA reported; else the device's total memory when recorded) and `memory_limit_bytes`
    (a per-process memory fraction's cap), each with where it came from."""
    from ..oom import allocator_limit

    out = {"device_memory_bytes": None, "device_memory_source": "unknown: no limit assumed",
           "memory_limit_bytes": allocator_limit(trace, device), "memory_limit_source": None}
    if out["memory_limit_bytes"] is not None:
        out["memory_limit_source"] = "the recording (torch.cuda.set_per_process_memory_fraction)"
    ev = trace.events
    sl = ev.device_slice(device)
    ooms = np.flatnonzero(ev.action[sl] == OOM)
    if len(ooms) and exact is not None:
        i = int(ooms[0])
        out["device_memory_bytes"] = exact.reserved_at(i) + int(ev.device_free[sl][i])
        out["device_memory_source"] = f"reserved at the out-of-memory entry {i} plus the free memory CUDA reported then"
    else:
        for d in (trace.recorder or {}).get("devices") or []:
            if isinstance(d, dict) and d.get("index") == device and isinstance(d.get("total_memory"), int):
                out["device_memory_bytes"] = d["total_memory"]
                out["device_memory_source"] = "the device's total memory (CUDA's own use not taken off)"
    return out


def compare(trace: Trace, config: AllocatorConfig, start: str = DEFAULT_START, device_memory=None,
            memory_limit=None) -> dict:
    """The what-if on allocator settings, per device, as JSON-ready builtins: the recorded figures, the model
    under the recorded settings (the baseline) and under `config`, from the same start."""
    from .model_replay import settings_of

    recorded, notes = settings_of(trace)
    devices = [compare_device(trace, d, config, start, device_memory, memory_limit) for d in trace.devices]
    return {"file": trace.path, "alloc_conf": config.text, "recorded_settings": recorded.describe(),
            "whatif_settings": config.describe(), "start": start, "devices": devices}


def compare_device(trace: Trace, d: int, config: AllocatorConfig, start: str = DEFAULT_START, device_memory=None,
                   memory_limit=None) -> dict:
    """One device's row of `compare` (see there)."""
    from .model_replay import settings_of, total_memory
    from .summary import _replays, allocator_replays, why_not_modelled

    recorded, notes = settings_of(trace)
    why = why_not_modelled(trace, d)
    if why is None and "window" in trace.meta:
        why = "a window of the trace: a what-if replays the whole recording"
    if why is None and d not in allocator_replays(trace):
        why = _replays(trace).get(d) or "not modelled"
    if why is not None:
        return {"device": d, "label": trace.device_label(d), "modelled": False, "why": why}
    exact = allocator_replays(trace)[d]
    lim = device_limits(trace, d, exact)
    if device_memory is not None:
        lim["device_memory_bytes"], lim["device_memory_source"] = device_memory, "--device-memory"
    if memory_limit is not None:
        lim["memory_limit_bytes"], lim["memory_limit_source"] = memory_limit, "--memory-limit"
    kw = dict(recorded=recorded, start=start, capacity=lim["device_memory_bytes"],
              memory_fraction_bytes=lim["memory_limit_bytes"], total_memory=total_memory(trace, d))
    base = replay_under_settings(trace, d, recorded, **kw)
    what = replay_under_settings(trace, d, config, **kw)
    dev_notes = list(notes)
    if config.garbage_collection_threshold and lim["memory_limit_bytes"] is None:
        dev_notes.append("garbage_collection_threshold acts only under a per-process memory fraction "
                         "(torch.cuda.set_per_process_memory_fraction); none is known for this file, so it "
                         "changes nothing here: give --memory-limit")
    if exact.initial_allocated or exact.initial_reserved:
        how = ("from that state, rebuilt from the final segments as the report's replay rebuilds it"
               if start == "recorded" else "from an empty allocator that first allocates what was held then")
        dev_notes.append(f"the trace begins with {exact.initial_allocated} bytes allocated and "
                         f"{exact.initial_reserved} reserved; both runs start {how} (--start)")
    off = base.peak_reserved - exact.peak_reserved
    baseline_check = {"recorded_peak_reserved_bytes": exact.peak_reserved,
                      "baseline_peak_reserved_bytes": base.peak_reserved, "difference_bytes": off,
                      "reproduced": off == 0, "why": None}
    if off:
        if start == "rebuilt" and (exact.initial_allocated or exact.initial_reserved):
            why_off = (f"--start rebuilt lays out the {exact.initial_allocated} bytes held when the trace began "
                       f"from an empty allocator, not where the file has them; --start recorded reproduces the "
                       f"recorded state")
        elif not exact.exact:
            why_off = f"the replay of the file is not exact ({exact_why(exact)})"
        else:
            why_off = "the model under the recorded settings decides differently from the file (see the notes)"
        baseline_check["why"] = why_off
        share = off / exact.peak_reserved if exact.peak_reserved else 0.0
        dev_notes.append(f"the baseline's reserved peak is {off:+,} bytes ({share:+.2%}) from the recorded one: "
                         f"{why_off}")
    oom = None
    if base.failed_request is not None or what.failed_request is not None:
        f = what.failed_request or base.failed_request
        assert f is not None
        oom = {"index": f["index"], "request_bytes": f["request_bytes"], "recorded": "failed",
               "baseline_fits": (base.failed_request or {}).get("fits"),
               "whatif_fits": (what.failed_request or {}).get("fits")}
        if oom["baseline_fits"]:
            dev_notes.append("the model under the recorded settings does not reproduce this out-of-memory "
                             "error from this start, so its answer for the other settings is not reliable")
    return {
        "device": d, "label": trace.device_label(d), "modelled": True, **lim,
        "recorded": {"peak_reserved_bytes": exact.peak_reserved, "peak_allocated_bytes": exact.peak_allocated,
                     "exact": exact.exact},
        "baseline": _run_dict(base), "whatif": _run_dict(what),
        "baseline_check": baseline_check,
        "saved_reserved_bytes": base.peak_reserved - what.peak_reserved,
        "oom": oom, "notes": dev_notes}


def exact_why(exact) -> str:
    if exact.unplaced_events:
        return f"{exact.unplaced_events} allocations not placed"
    return "the file leaves the size of some blocks held before the trace open"


@per_trace
def expandable_replay(trace: Trace, device: int) -> dict:
    """What `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` would do on this device: the device row of
    `whatif FILE --alloc-conf expandable_segments:True` (same settings, same start), computed once per trace.
    {"modelled": False, "why": ...} where the allocator model does not apply."""
    from .config import parse_alloc_conf

    return compare_device(trace, device, parse_alloc_conf(EXPANDABLE), DEFAULT_START)


def expandable_saving(trace: Trace, device: int) -> dict | None:
    """What expandable segments would save on the device, from the allocator replay (the device row of
    `whatif --alloc-conf expandable_segments:True`, allocator/settings_replay.expandable_replay): {saves_bytes,
    baseline_bytes, whatif_bytes, text}; None where the allocator model does not apply. The report's
    fragmentation finding and the expandable-segments lever (levers.py) both read this."""
    from ...units import fmt_bytes

    r = expandable_replay(trace, device)
    if not r.get("modelled"):
        return None
    base, what = r["baseline"]["peak_reserved_bytes"], r["whatif"]["peak_reserved_bytes"]
    saved = base - what
    change = f"{fmt_bytes(saved)} less" if saved > 0 else ("the same" if saved == 0 else f"{fmt_bytes(-saved)} more")
    text = (f"Replayed with PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE}, the allocator model reserves {fmt_bytes(what)} at "
            f"its peak against {fmt_bytes(base)} under the recorded settings: {change} "
            f"(tracekit whatif FILE --alloc-conf {EXPANDABLE})")
    return {"saves_bytes": int(saved), "baseline_bytes": int(base), "whatif_bytes": int(what), "text": text}
