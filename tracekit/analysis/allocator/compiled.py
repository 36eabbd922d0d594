"""The replay of a trace through the allocator model: the compiled loop (_replay.c) when it is built and
the file is one it handles (no expandable segments, no private pools), else model_replay.py's Python loop.

Both are exact and make the same decisions entry for entry (tests/test_allocator_props.py compares them on random
streams and the recordings, tests/test_allocator_compiled.py their constants and the state at an entry);
TRACEKIT_ALLOCATOR=python forces the Python loop.
"""
from __future__ import annotations

import os
from typing import Callable

import numpy as np

from ...model import (ALLOC, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP, Trace, constant_column, isin_few,
                      one_or_all)
from .config import AllocatorConfig
from .core import Allocator, Device
from .model_replay import (REASONS, AllocatorReplay, compare_final, replay_device_in_python as _python, settings_of,
                           total_memory)
from .state import initial_state, load

_compiled: Callable[..., tuple] | None
try:
    from ._replay import replay as _compiled
except ImportError:  # no C compiler when installed: the Python loop does the same, more slowly
    _compiled = None


def compiled_available() -> bool:
    return _compiled is not None


def replay_device(trace: Trace, device: int, config: AllocatorConfig | None = None) -> AllocatorReplay:
    """Replay one device's trace through the allocator model: the compiled loop where it can, else Python."""
    return _replay(trace, device, config)[0]


def segments_at(trace: Trace, device: int, index: int) -> list[dict]:
    """The device's segments just after trace entry `index` (-1: before the first), as the replay has them:
    [{address, total_size, blocks: [{address, size, state}]}], by address."""
    if index < 0:
        alloc = Allocator(settings_of(trace)[0], Device(total_memory=total_memory(trace, device)))
        load(alloc, initial_state(trace, device, alloc.config))
        return _plain(alloc.snapshot())
    res, final = _replay(trace, device, None, stop=index)
    if final is not None:
        states = ("inactive", "active_allocated", "active_pending_free")
        out: list = []
        for a, z, st, head in sorted(final, key=lambda x: x[0]):
            if head or not out or out[-1]["address"] + out[-1]["total_size"] != a:
                out.append({"address": a, "total_size": 0, "blocks": []})
            out[-1]["blocks"].append({"address": a, "size": z, "state": states[st]})
            out[-1]["total_size"] += z
        return out
    _, alloc = _python(trace, device, None, stop_after=index)
    return _plain(alloc.snapshot())


def _plain(snapshot):
    return [{"address": s["address"], "total_size": s["total_size"],
             "blocks": [{"address": b["address"], "size": b["size"], "state": b["state"]} for b in s["blocks"]]}
            for s in snapshot]


def compiled_replay(action: np.ndarray, addr: np.ndarray, size: np.ndarray, stream: np.ndarray, start: Allocator,
                    config: AllocatorConfig, out_allocated: np.ndarray, out_reserved: np.ndarray,
                    out_block: np.ndarray, stop: int = -1,
                    out_entries: np.ndarray | None = None) -> tuple[int, int, list[int], int, int, list]:
    """_replay.replay with its arguments named: the entries' columns (`stream` may be one value, every
    entry's), the allocator `start` holding the state at the first entry (its blocks and segments become the
    C loop's arrays), the settings, the per-entry outputs (`out_reserved` may be one value where no entry is a
    segment_alloc or segment_free); with `out_entries`, `out_block` is sparse: the blocks the allocs got, in
    order, their entries in `out_entries`."""
    assert _compiled is not None
    blocks = sorted(start.blocks.values(), key=lambda b: b.addr)
    segs = sorted(start.segments.items())
    u64 = lambda xs: np.asarray(xs, np.uint64)  # noqa: E731
    i64 = lambda xs: np.asarray(xs, np.int64)  # noqa: E731
    return _compiled(
        action, addr, size, stream,
        u64([b.addr for b in blocks]), i64([b.size for b in blocks]), i64([b.stream for b in blocks]),
        np.asarray([1 if b.allocated else 2 if b.pending else 0 for b in blocks], np.int8),
        np.asarray([b.pool.small for b in blocks], np.int8), u64([b.seg for b in blocks]),
        i64([b.requested for b in blocks]), u64([a for a, _ in segs]), i64([z for _, z in segs]),
        i64(config.roundup_power2_divisions), int(config.max_split_size), int(config.max_non_split_rounding),
        out_allocated, out_reserved, out_block, stop, out_entries)


def _sparse(block_sizes: np.ndarray, entries: np.ndarray) -> dict:
    """AllocatorReplay's block_entries and block_sizes from the compiled replay's sparse output: the first k of
    each, k the blocks it put (none is 0; what follows them was left as made, 0)."""
    k = int(np.count_nonzero(block_sizes))
    if k == len(block_sizes):
        return {"block_entries": entries, "block_sizes": block_sizes}
    return {"block_entries": entries[:k].copy(), "block_sizes": block_sizes[:k].copy()}


def _replay(trace, device, config, stop=None):
    """(AllocatorReplay, the compiled loop's blocks at the end or None when Python ran it)."""
    if not compiled_available() or os.environ.get("TRACEKIT_ALLOCATOR") == "python":
        return (_python(trace, device, config) if stop is None else None), None
    notes = []
    if config is None:
        config, notes = settings_of(trace)
    python = (lambda: (_python(trace, device, config), None)) if stop is None else (lambda: (None, None))
    if config.expandable_segments:
        return python()
    ev = trace.events
    sl = ev.device_slice(device)
    action = np.ascontiguousarray(ev.action[sl], np.int8)
    if isin_few(action, (SEGMENT_MAP, SEGMENT_UNMAP)).any():
        return python()
    init = initial_state(trace, device, config)
    if any(r.expandable or r.pool_id for r in init.regions):
        return python()
    alloc = Allocator(config, Device(total_memory=total_memory(trace, device)))
    load(alloc, init)
    n = len(action)
    if stop is not None and 0 <= stop < n - 1:  # the state after entry `stop`: only the entries up to it are read
        n, action, sl = stop + 1, action[:stop + 1], slice(sl.start, sl.start + stop + 1)
    # reserved bytes change only at segment entries: without any, one value stands for the curve; the blocks
    # the allocs get come sparse (AllocatorReplay's block_entries and block_sizes), not one per entry
    fixed_reserved = not isin_few(action, (SEGMENT_ALLOC, SEGMENT_FREE)).any()
    out_alloc, out_res = np.zeros(n, np.int64), np.zeros(1 if fixed_reserved else n, np.int64)
    n_allocs = int(np.count_nonzero(action == ALLOC))
    out_blk, out_ent = np.zeros(n_allocs, np.int64), np.empty(n_allocs, np.int32 if n < 2**31 else np.int64)
    placed, slack, counts, alloc0, res0, final = compiled_replay(
        action, np.ascontiguousarray(ev.addr[sl], np.uint64), np.ascontiguousarray(ev.size[sl], np.int64),
        one_or_all(ev.stream[sl], np.int64), alloc, config, out_alloc, out_res, out_blk,
        -1 if stop is None else int(stop), out_ent)
    if stop is not None:
        return None, final
    if fixed_reserved:
        out_res = constant_column(res0, n, np.int64) if n > 1 else np.full(n, res0, np.int64)
    unplaced = {REASONS[k]: int(c) for k, c in enumerate(counts) if c}
    mismatch = -1
    if trace.meta.get("has_segments", True):
        states = ("inactive", "active_allocated", "active_pending_free")
        mismatch = compare_final(trace, device, {a: (z, states[s]) for a, z, s, _ in final},
                                 bool(alloc.segments))
    return AllocatorReplay(device=device, config=config, allocated=out_alloc, reserved=out_res,
                           initial_allocated=int(alloc0), initial_reserved=int(res0), **_sparse(out_blk, out_ent),
                           placed=int(placed), unplaced=unplaced, open_bytes=init.open_bytes,
                           final_mismatch=mismatch, initial=init, notes=notes, unplaced_slack=int(slack),
                           engine="compiled"), final
