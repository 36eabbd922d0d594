"""Predicted figures from a simulated request stream (tracekit/simulate/), and the simulation beside a recording.

The simulator writes the stream a CUDA recording of the same step would hold: one `alloc` per tensor
storage (the requested size), its `free_requested` / `free_completed` when it is released, stacks,
phases, a category per entry. Everything here is plain replay over that stream (no torch):

- `serve_simulated_stream`: what each request costs the allocator (what `torch.cuda.memory_allocated()` counts)
  and what is reserved: the stream served, in order, by the model of PyTorch's caching allocator
  (analysis/allocator: its rounding, pools, best fit, splits and segments) under the default settings
  (or the stream's recorded `allocator_settings`), from an empty allocator as a fresh process starts.
- `simulated_peak`: `max_memory_allocated` over the measured steps (after the warm-up), the categories
  and the lines live at that moment.
- `compare`: the simulation beside a recording of the same workload, category by category and line by
  line, the difference itemized.
- `largest_fitting`: the largest batch (or sequence) whose simulated peak fits a budget, by bisection
  over simulated runs.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import numpy as np

from ...model import NO_TIME, Trace
from ..replay import block_size, replay

ROUNDING = ("block sizes: requests rounded up to 512 B; a request of 10 MiB or more takes its whole new segment "
            "(rounded up to 2 MiB) when the rest is 1 MiB or less (CUDACachingAllocator's usual case)")
RESERVED = "not modelled (the caching-allocator model could not serve this stream)"
BEFORE = "(made before the measured steps)"


def block_sizes(requested) -> np.ndarray:
    """Bytes the CUDA caching allocator counts for each request in its usual case (a fresh block)."""
    return block_size(np.asarray(requested, np.int64))


@dataclass
class SimulatedBlocks:
    """The caching allocator's view of a stream: each allocation's block size, allocated bytes after every entry
    (torch.cuda.memory_allocated), reserved bytes after every entry (None: not modelled), and how it was made."""

    sizes: np.ndarray  # int64 per allocation (rows of replay(trace)[device].allocations)
    curve: np.ndarray  # int64 per entry
    initial: int
    reserved: np.ndarray | None
    how: str


def serve_simulated_stream(trace: Trace, device: int = 0) -> SimulatedBlocks:
    """The request stream served in order by the caching-allocator model (analysis/allocator): each request's
    block, allocated and reserved bytes after every entry. Falls back to the usual-case block sizes (reserved
    not modelled) only where the model cannot serve the stream."""
    rep = replay(trace)[device]
    try:
        from ..allocator.model_replay import settings_of
        from ..allocator.settings_replay import replay_under_settings

        config, _ = settings_of(trace)
        run = replay_under_settings(trace, device, config, recorded=config, start="rebuilt", curves=True)
    except Exception:  # noqa: BLE001 - the model refused the stream: the usual case per request, no reserved figure
        run = None
    if run is None or run.ooms:
        sizes = block_sizes(rep.allocations.size)
        curve, initial = _curve(rep, sizes)
        return SimulatedBlocks(sizes=sizes, curve=curve, initial=initial, reserved=None,
                               how="replay of the simulated request stream, " + ROUNDING)
    al = rep.allocations
    sizes = block_sizes(al.size)  # allocations made before the stream (none in a simulation): the usual case
    traced = al.alloc_index >= 0
    assert run.blocks is not None  # replayed with curves=True
    sizes[traced] = run.blocks[al.alloc_index[traced]]
    curve, initial = _curve(rep, sizes)
    return SimulatedBlocks(sizes=sizes, curve=curve, initial=initial, reserved=run.reserved,
                           how="the simulated request stream served by the caching-allocator model "
                               "(analysis/allocator, default settings, from an empty allocator)")


def peak_reserved(trace: Trace, device: int = 0, index: int | None = None):
    """max_memory_reserved of a simulated stream over its measured steps (None where the model could not serve it)."""
    got = serve_simulated_stream(trace, device).reserved
    if got is None:
        return None
    start = measured_start(trace)
    times = trace.events.time_us[replay(trace)[device].events]
    return int(got[times >= start].max()) if (times >= start).any() else int(got.max())


@dataclass
class SimulatedPeak:
    peak_allocated_bytes: int  # block sizes (max_memory_allocated's sense), measured steps
    peak_requested_bytes: int  # the requests live at that moment, unrounded
    peak_reserved_bytes: int | None
    iteration: int | None
    phase: str | None
    at: str  # the line that made the allocation reaching the peak
    run_peak_allocated_bytes: int  # over the whole run: setup, warm-up and measured steps
    categories_at_peak: dict
    lines_at_peak: list
    how: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


# -- lines ----------------------------------------------------------------------------------------------------

_NODE = re.compile(r"((?<!\w)\w+Backward\d*)(?:::apply|_apply_functional)|(AccumulateGrad)")
_OP = re.compile(r"at::_ops::(\w+?)(?:_(?:Tensor|Scalar|int|dim_IntList|default|memory_format|self))?::call")


def _internal(filename: str) -> bool:
    """torch's own Python (nn.Module's call machinery, functional.py...), not the line that asked."""
    sf = short_file(filename)
    return sf.startswith("torch/") or filename.startswith("<") or sf in ("tracekit/simulate/engine.py",
                                                                         "tracekit/simulate/kernels.py")


def short_file(filename: str) -> str:
    """A path as both machines would write it: from the installed package's folder, else the file name."""
    f = filename.replace("\\", "/")
    if "site-packages/" in f:
        return f.rsplit("site-packages/", 1)[1]
    if "/tracekit/" in f:
        return "tracekit/" + f.rsplit("/tracekit/", 1)[1]
    return f.rsplit("/", 1)[-1]


def line_of(frames: list) -> tuple:
    """(key, label) of the line that made an allocation: the autograd node for backward (recordings of the
    backward thread have no Python stack), a cuBLAS workspace, else the first Python frame outside torch."""
    node = op = None
    py = None
    for f in frames:
        name, fn = f.get("name", ""), f.get("filename", "")
        if "Workspace" in name and "cuda" in name:
            what = "cuBLASLt workspace" if "Lt" in name else "cuBLAS workspace"
            return (what,), what
        if node is None:
            m = _NODE.search(name)
            if m:
                node = m.group(1) or m.group(2)
        if op is None:
            m = _OP.match(name)
            if m:
                op = m.group(1)
        if py is None and fn.endswith(".py") and not _internal(fn):
            py = f
    if node is not None:
        return ("backward", node), f"backward: {node}"
    if py is not None:
        sf = short_file(py["filename"])
        return (sf, py["name"], py["line"]), f"{sf}:{py['line']} in {py['name']}"
    if op is not None:
        return ("op", op), op
    return ("no stack",), "(no stack)"


# -- the peak of a simulated stream -------------------------------------------------------------------------------

def measured_start(trace: Trace) -> int:
    """time_us where the measured steps begin (after the warm-up), from the simulator's marks."""
    tk = trace.recorder or {}
    sim = tk.get("simulated") or {}
    warmup = int((sim.get("workload") or {}).get("warmup", 0))
    its = tk.get("iterations") or []
    if warmup < len(its):
        return int(its[warmup]["start_us"])
    return int(NO_TIME)


def simulated_peak(trace: Trace, device: int = 0, lines: int = 10) -> SimulatedPeak:
    """max_memory_allocated of the measured steps of a simulated stream, what is live then, and where from."""
    rep = replay(trace)[device]
    al = rep.allocations
    ev = trace.events
    sl = rep.events
    allocator = serve_simulated_stream(trace, device)
    sizes, curve, initial = allocator.sizes, allocator.curve, allocator.initial
    times = ev.time_us[sl]
    start = measured_start(trace)
    measured = times >= start
    if not measured.any():
        measured[:] = True
    idx = int(np.flatnonzero(measured)[np.argmax(curve[measured])])
    live = al.live_at(idx)
    cats = _categories(trace, rep)
    by_cat: dict = {}
    for c, b in zip(cats[live], sizes[live]):
        by_cat[c] = by_cat.get(c, 0) + int(b)
    md = trace.strings[ev.user_metadata[sl][idx]]
    m = re.search(r"iter=(-?\d+)(?::phase=(\w+))?", md)
    peak_row = int(np.flatnonzero(al.alloc_index == idx)[0]) if (al.alloc_index == idx).any() else None
    at = line_of(trace.stack(int(al.stack_id[peak_row])))[1] if peak_row is not None else ""
    before = _before_measured(trace, rep, start)
    return SimulatedPeak(
        peak_allocated_bytes=int(curve[idx]),
        peak_requested_bytes=int(al.size[live].sum()),
        peak_reserved_bytes=peak_reserved(trace, device),
        iteration=int(m.group(1)) if m else None,
        phase=(m.group(2) if m else None),
        at=at,
        run_peak_allocated_bytes=int(max(initial, curve.max())) if len(curve) else initial,
        categories_at_peak=dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
        lines_at_peak=_lines(trace, rep, live, sizes, cats, before)[:lines],
        how={
            "peak_allocated_bytes": allocator.how,
            "peak_reserved_bytes": RESERVED if allocator.reserved is None else allocator.how,
            "categories_at_peak": "the simulator's own labels (it knows which tensor each storage holds: parameters, "
                                  "gradients, optimizer state; forward storages alive when backward begins are "
                                  "activations (autocast's saved weight copies included); cuBLAS workspaces are workspace)",
            "window": "measured steps only (after the warm-up step), as max_memory_allocated after "
                      "reset_peak_memory_stats",
        },
    )


def _curve(rep, sizes):
    al = rep.allocations
    delta = np.zeros(rep.n + 1, np.int64)
    traced, freed = al.alloc_index >= 0, al.free_index >= 0
    np.add.at(delta, al.alloc_index[traced], sizes[traced])
    np.add.at(delta, al.free_index[freed], -sizes[freed])
    initial = int(sizes[~traced].sum())
    return initial + np.cumsum(delta[:-1]), initial


def _categories(trace: Trace, rep) -> np.ndarray:
    """The category the simulator wrote on each allocation's alloc entry."""
    al = rep.allocations
    cat_ids = trace.events.category[rep.events]
    out = np.empty(len(al), object)
    traced = al.alloc_index >= 0
    names = np.array(trace.strings.items, dtype=object)
    out[traced] = names[cat_ids[al.alloc_index[traced]]]
    out[~traced] = "other"
    out[out == ""] = "other"
    return out


def _before_measured(trace: Trace, rep, start: int) -> np.ndarray:
    al = rep.allocations
    times = trace.events.time_us[rep.events]
    made = np.where(al.alloc_index >= 0, times[np.maximum(al.alloc_index, 0)], np.iinfo(np.int64).min)
    return (al.alloc_index < 0) | (made < start)


def _lines(trace, rep, live, sizes, cats, before) -> list:
    """Live allocations grouped by (category, line), largest first."""
    al = rep.allocations
    groups: dict = {}
    memo: dict = {}
    for r in np.flatnonzero(live).tolist():
        if before[r]:
            key, label = (BEFORE,), BEFORE
        else:
            sid = int(al.stack_id[r])
            got = memo.get(sid)
            if got is None:
                got = memo[sid] = line_of(trace.stack(sid)) if sid >= 0 else (("no stack",), "(no stack)")
            key, label = got
        g = groups.setdefault((cats[r], key), {"category": cats[r], "line": label, "bytes": 0, "count": 0,
                                               "key": list(key)})
        g["bytes"] += int(sizes[r])
        g["count"] += 1
    return sorted(groups.values(), key=lambda g: -g["bytes"])


# -- beside a recording --------------------------------------------------------------------------------------

def recorded_peak(trace: Trace, device: int | None = None, lines: int = 10) -> dict:
    """A recording's max_memory_allocated (block sizes), categories and lines at its peak."""
    from ..categories import categorize
    from ..replay import allocator_bytes

    reps = replay(trace)
    if device is None:
        device = max(reps, key=lambda d: reps[d].peak_allocated) if reps else 0
    if device not in reps:
        raise ValueError(f"the recording has no device {device}")
    rep = reps[device]
    from ..allocator.summary import allocator_replays

    ab = allocator_bytes(trace, rep)
    sizes, curve, initial, peak = ab.sizes.copy(), ab.curve, ab.initial, ab.peak
    model = allocator_replays(trace).get(device)  # the report's own figures: the allocator model's blocks
    if model is not None:
        traced = rep.allocations.alloc_index >= 0
        got = model.block_size_at(rep.allocations.alloc_index[traced])
        sizes[traced] = np.where(got > 0, got, sizes[traced])
        curve, initial, peak = model.allocated, model.initial_allocated, model.peak_allocated
    idx = int(np.argmax(curve)) if len(curve) and curve.max() >= initial else -1
    live = rep.allocations.live_at(idx)
    dc = categorize(trace)[device]
    cats = dc.label_names()
    by_cat: dict = {}
    for c, b in zip(cats[live], sizes[live]):
        by_cat[c] = by_cat.get(c, 0) + int(b)
    before = rep.allocations.alloc_index < 0
    tk = trace.recorder or {}
    its = tk.get("iterations") or []
    if its:  # our recorder's files: the first iteration is the measured start
        before = _before_measured(trace, rep, int(its[0]["start_us"]))
    requested = rep.allocations.size.copy()  # the trace's sizes are requests; blocks made before it have
    b = trace.blocks  # their request in the final segments (a block's size is the allocator's)
    final = dict(zip(b.addr[b.device == device].tolist(), b.requested_size[b.device == device].tolist()))
    for r in np.flatnonzero(rep.allocations.alloc_index < 0).tolist():
        got = final.get(int(rep.allocations.addr[r]))
        if got:
            requested[r] = got
    return {"peak_allocated_bytes": peak, "peak_requested_bytes": int(requested[live].sum()),
            "device": device, "categories_at_peak": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
            "lines_at_peak": _lines(trace, rep, live, sizes, cats, before)[:max(lines, 1000)],
            "peak_reserved_bytes": rep.peak_reserved}


def compare(sim: Trace, recorded: Trace, lines: int = 12) -> dict:
    """The simulation beside a recording: peaks, categories at each peak and the largest lines, with
    the difference (simulated - recorded) itemized."""
    sp = simulated_peak(sim, lines=1000)
    rp = recorded_peak(recorded)
    cats = sorted(set(sp.categories_at_peak) | set(rp["categories_at_peak"]),
                  key=lambda c: -max(sp.categories_at_peak.get(c, 0), rp["categories_at_peak"].get(c, 0)))
    by_category = [{"category": c, "simulated": sp.categories_at_peak.get(c, 0),
                    "recorded": rp["categories_at_peak"].get(c, 0),
                    "difference": sp.categories_at_peak.get(c, 0) - rp["categories_at_peak"].get(c, 0)}
                   for c in cats]
    rows: dict = {}
    for side, groups in (("simulated", sp.lines_at_peak), ("recorded", rp["lines_at_peak"])):
        for g in groups:
            key = tuple(g["key"])
            row = rows.setdefault(key, {"line": g["line"], "simulated": 0, "recorded": 0, "categories": set()})
            row[side] += g["bytes"]
            row["categories"].add(g["category"])
            if side == "recorded" and row["simulated"] == 0:
                row["line"] = g["line"]
    _pair_moved_lines(rows)
    table = []
    for key, row in rows.items():
        table.append({"line": row["line"], "categories": sorted(row["categories"]), "simulated": row["simulated"],
                      "recorded": row["recorded"], "difference": row["simulated"] - row["recorded"]})
    largest = sorted(table, key=lambda r: -max(r["simulated"], r["recorded"]))[:lines]
    itemized = sorted((r for r in table if r["difference"]), key=lambda r: -abs(r["difference"]))[:lines]
    diff = sp.peak_allocated_bytes - rp["peak_allocated_bytes"]
    return {
        "simulated": {"peak_allocated_bytes": sp.peak_allocated_bytes, "peak_requested_bytes": sp.peak_requested_bytes,
                      "peak_reserved_bytes": sp.peak_reserved_bytes},
        "recorded": {"peak_allocated_bytes": rp["peak_allocated_bytes"],
                     "peak_requested_bytes": rp["peak_requested_bytes"],
                     "peak_reserved_bytes": rp["peak_reserved_bytes"], "device": rp["device"]},
        "difference_bytes": diff,
        "difference_percent": round(100.0 * diff / rp["peak_allocated_bytes"], 2) if rp["peak_allocated_bytes"] else None,
        "requested_difference_bytes": sp.peak_requested_bytes - rp["peak_requested_bytes"],
        "by_category": by_category,
        "largest_lines": largest,
        "itemized": itemized,
        "note": "recorded categories are tracekit's (tags in our recordings, inferred from phases, lifetimes and "
                "stacks in anyone else's); lines match by file and function (line numbers differ between library "
                "versions) or by autograd node; blocks made before the measured steps are one line",
    }


def _pair_moved_lines(rows: dict):
    """Lines of the same file and function that hold the same bytes on both sides but have different line
    numbers (another version of the library): one row, both numbers shown."""
    only_sim = [k for k, r in rows.items() if len(k) == 3 and r["recorded"] == 0 and r["simulated"]]
    only_rec = [k for k, r in rows.items() if len(k) == 3 and r["simulated"] == 0 and r["recorded"]]
    taken = set()
    for ks in only_sim:
        for kr in only_rec:
            if kr in taken or kr[:2] != ks[:2] or rows[kr]["recorded"] != rows[ks]["simulated"]:
                continue
            taken.add(kr)
            rs, rr = rows[ks], rows.pop(kr)
            rs["recorded"] = rr["recorded"]
            rs["categories"] |= rr["categories"]
            rs["line"] = f"{ks[0]}:{ks[2]} (recorded: line {kr[2]}) in {ks[1]}"
            break


# -- what fits -----------------------------------------------------------------------------------------------

def device_demand(trace: Trace, device: int = 0) -> tuple[int, str]:
    """(bytes, what) the run needs from the device: the caching allocator's reserved peak over the whole run
    (setup and warm-up included: they must fit too), or the allocated peak where reserved is not modelled."""
    got = serve_simulated_stream(trace, device)
    if got.reserved is not None and len(got.reserved):
        return int(got.reserved.max()), "reserved"
    return int(max(got.curve.max() if len(got.curve) else 0, got.initial)), "allocated"


def fits(peak: int, capacity: int | None, by: str = "allocated") -> dict | None:
    """Whether a peak fits a device or budget, and by how much (positive: room left); `by`: which peak it is."""
    if capacity is None:
        return None
    return {"capacity_bytes": int(capacity), "fits": peak <= capacity, "margin_bytes": int(capacity - peak),
            "peak_bytes": int(peak), "by": by}


def largest_fitting(evaluate, budget: int, start: int = 1, limit: int = 1 << 16) -> dict:
    """The largest n in [1, limit] with evaluate(n) <= budget, for a peak that grows with n.

    Every answer comes from simulated runs: two runs give a straight-line guess of where the budget is
    crossed (only to place the first bracket), runs around the guess bracket it (lo fits, hi does not,
    widening geometrically), then bisection closes the bracket to lo + 1 = hi. `tries` lists every run."""
    tries, seen = [], {}

    def run(n):
        if n not in seen:
            peak = int(evaluate(n))
            seen[n] = peak
            tries.append({"value": n, "peak_allocated_bytes": peak, "fits": peak <= budget})
        return seen[n] <= budget

    start = max(1, min(start, limit))
    lo, hi = (start, None) if run(start) else (None, start)
    if lo is None and start == 1:
        return {"largest": None, "budget_bytes": budget, "tries": tries}
    second = min(limit, start * 2) if lo is not None else max(1, start // 2)
    if second != start:
        if run(second):
            lo = max(lo or 0, second)
        else:
            hi = min(hi or second, second)
    a, b = sorted((start, second))
    guess = None
    if a != b and seen[b] != seen[a]:
        slope = (seen[b] - seen[a]) / (b - a)
        if slope > 0:
            guess = int(a + (budget - seen[a]) / slope)
    if guess is not None and (lo is None or guess > lo) and (hi is None or guess < hi):
        guess = max(1, min(limit, guess))
        if run(guess):
            lo = guess
        else:
            hi = guess
    step = max(1, (lo or hi or 1) // 16)
    while hi is None:  # widen upwards from the last run that fits
        assert lo is not None  # no upper bound yet: the start fitted
        if lo >= limit:
            return {"largest": lo, "budget_bytes": budget, "tries": tries, "limit_reached": True}
        nxt = min(limit, lo + step)
        step *= 2
        if run(nxt):
            lo = nxt
        else:
            hi = nxt
    while lo is None:  # widen downwards from the last run that does not fit
        nxt = max(1, hi - step)
        step *= 2
        if run(nxt):
            lo = nxt
        elif nxt == 1:
            return {"largest": None, "budget_bytes": budget, "tries": tries}
        else:
            hi = nxt
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if run(mid):
            lo = mid
        else:
            hi = mid
    return {"largest": lo, "budget_bytes": budget, "tries": tries}
