"""What pytorch.org/memory_viz (torch/utils/viz/MemoryViz.js) needs of a file, checked in Python.

Written from reading the page's loader, independently of tracekit's writer:
`problems(data)` returns the reasons the page would fail on these pickle
bytes (empty when it would render). It walks the same steps the page does:
its own unpickler (a fixed set of opcodes), the annotation pass (fields it
reads, categories, blocks), the device menu, and the "Allocator State
History" (undoing entries from the end state: every block inside a segment,
every free_requested of an existing block).
"""
from __future__ import annotations

import bisect
import pickletools

# Opcodes the page's unpickler implements; anything else throws "UNKNOWN OPCODE".
PAGE_OPCODES = {
    "PROTO", "APPEND", "APPENDS", "LIST", "TUPLE", "NEWFALSE", "NEWTRUE", "NONE", "BINGET", "BININT",
    "BININT1", "BININT2", "EMPTY_DICT", "EMPTY_LIST", "FRAME", "LONG1", "LONG_BINGET", "MARK", "MEMOIZE",
    "BINPUT", "LONG_BINPUT", "SETITEMS", "SETITEM", "DICT", "SHORT_BINUNICODE", "BINUNICODE", "STOP",
    "EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "BINFLOAT",
}
JS_SAFE = 2**53


def opcode_problems(data: bytes) -> list[str]:
    out = []
    for op, arg, pos in pickletools.genops(data):
        if op.name not in PAGE_OPCODES:
            out.append(f"opcode {op.name} at byte {pos} is not understood by the page")
        elif op.name == "PROTO" and not 2 <= arg <= 4:
            out.append(f"pickle protocol {arg}: the page reads 2 to 4")
        elif op.name == "LONG1" and isinstance(arg, int) and abs(arg) >= JS_SAFE:
            out.append(f"integer {arg} at byte {pos} is not exact as a JavaScript number")
        if len(out) >= 5:
            break
    return out


def problems(data: bytes) -> list[str]:
    import pickle

    out = opcode_problems(data)
    if out:
        return out
    snap = pickle.loads(data)  # test-only: the bytes come from our own writer
    if not isinstance(snap, dict) or not isinstance(snap.get("segments"), list) \
            or not isinstance(snap.get("device_traces"), list):
        return ["the top level must be a dict with a 'segments' list and a 'device_traces' list"]
    out += _annotate(snap)
    if out:
        return out
    offered = [i for i, t in enumerate(snap["device_traces"])
               if t or any(s.get("device") == i for s in snap["segments"])]
    if not offered:
        return ["no device to show: every device_traces list is empty and no segment has a device in range"]
    for d in offered:
        out += _state_history(snap, d)
    return out[:20]


def _frames_ok(frames, where):
    if not isinstance(frames, list):
        return [f"{where}: frames is not a list"]
    for f in frames:
        if not (isinstance(f, dict) and isinstance(f.get("filename"), str) and isinstance(f.get("name"), str)):
            return [f"{where}: a frame without a str filename and name"]
    return []


def _annotate(snap) -> list[str]:
    out, categories = [], []
    for d, trace in enumerate(snap["device_traces"]):
        prev = None
        for i, t in enumerate(trace):
            where = f"device {d} entry {i}"
            act = t.get("action")
            if not isinstance(act, str):
                out.append(f"{where}: action is not a str")
                continue
            out += _frames_ok(t.get("frames", []), where)
            if act not in ("oom", "snapshot") and not isinstance(t.get("addr"), int):
                out.append(f"{where}: {act} without an int addr")
            if act != "snapshot" and not isinstance(t.get("size"), int):
                out.append(f"{where}: {act} without an int size")
            elided = (act == "free_completed" and prev is not None and prev.get("action") == "free_requested"
                      and prev.get("addr") == t.get("addr"))
            if not elided:
                if "category" in t and t["category"] not in categories:
                    categories.append(t["category"])
                prev = t
    if categories and "unknown" not in categories:
        out.append(f"entries carry categories {categories} but none is 'unknown': the page throws a TypeError")
    for k, seg in enumerate(snap["segments"]):
        where = f"segment {k}"
        if not isinstance(seg.get("blocks"), list):
            out.append(f"{where}: no blocks list")
            continue
        if not isinstance(seg.get("address"), int) or not isinstance(seg.get("total_size"), int):
            out.append(f"{where}: address and total_size must be ints")
        for b in seg["blocks"]:
            if "frames" in b:
                out += _frames_ok(b["frames"], where)
                if not isinstance(b.get("requested_size"), int):
                    out.append(f"{where}: a block with frames but no requested_size (its size is NaN in the page)")
            elif "history" in b and not (isinstance(b["history"], list) and b["history"]):
                out.append(f"{where}: a block with an empty history")
            if not isinstance(b.get("size"), int):
                out.append(f"{where}: a block without an int size")
    return out[:20]


def _live_blocks(snap, device):
    blocks = {}
    for seg in snap["segments"]:
        if seg.get("device") != device:
            continue
        addr = seg["address"]
        for b in seg["blocks"]:
            if b.get("state") in ("active_allocated", "active_pending_free"):
                blocks[addr] = b["size"]
            addr += b["size"]
    return blocks


def _state_history(snap, device) -> list[str]:
    """Allocator State History: undo entries from the end; every block must sit inside a segment."""
    segs = sorted((s["address"], s["total_size"]) for s in snap["segments"] if s.get("device") == device)
    starts = [a for a, _ in segs]
    blocks = set(_live_blocks(snap, device))

    def inside(addr):
        k = bisect.bisect_right(starts, addr) - 1
        return k >= 0 and addr < segs[k][0] + segs[k][1]

    out = [f"device {device}: final block {a:#x} outside every segment" for a in blocks if not inside(a)]
    entries = snap["device_traces"][device]
    # the page merges free_requested + free_completed of one address into one 'free'
    merged = []
    for t in entries:
        if (t["action"] == "free_completed" and merged and merged[-1][0] == "free_requested"
                and merged[-1][1] == t["addr"]):
            merged[-1] = ("free", t["addr"], t.get("size", 0))
        else:
            merged.append((t["action"], t.get("addr"), t.get("size", 0)))
    for i in range(len(merged) - 1, -1, -1):
        act, addr, size = merged[i]
        where = f"device {device} entry {i} ({act} {addr:#x})" if isinstance(addr, int) else f"entry {i}"
        if act in ("free", "free_completed"):
            blocks.add(addr)
            if not inside(addr):
                out.append(f"{where}: the block is outside every segment when undone")
        elif act == "free_requested":
            if addr not in blocks:
                out.append(f"{where}: free_requested of a block that does not exist (the page throws)")
        elif act == "alloc":
            blocks.discard(addr)
        elif act == "segment_free":
            k = bisect.bisect_left(starts, addr)
            starts.insert(k, addr)
            segs.insert(k, (addr, size))
        elif act == "segment_alloc":
            if addr in starts:
                k = starts.index(addr)
                del starts[k], segs[k]
        elif act in ("segment_map", "segment_unmap"):
            pass  # expandable segments: the page merges and splits; not produced by our writer
        if len(out) >= 5:
            break
    return out
