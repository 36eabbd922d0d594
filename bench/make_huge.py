#!/usr/bin/env python3
"""Make a snapshot of any number of trace entries (100M and more) without holding it in memory.

Usage: python bench/make_huge.py SOURCE.pickle OUT.pickle --entries N [--marks] [--reuse-addresses K]

The same content as ../shared/bench/tile_snapshot.py: the source's device-0 trace, then its balanced
part (every allocation freed within it) repeated K times back to back, each repetition's addresses
shifted by a fresh multiple of 2**40 and its times by the unit's span; the source's segments and other
keys unchanged. Unpickled, the file equals tile_snapshot.py's (tests/test_make_huge.py checks it), but
it is written as PyTorch's own snapshot is, where tile_snapshot.py deep-copies every frame list:

- torch symbolizes all tracebacks of a snapshot at once (torch/csrc/profiler/combined_traceback.cpp,
  py_symbolize): one dict per distinct frame for the whole file, one frames list per captured traceback,
  shared by the entries that hold it (an allocation and its frees). So frame dicts are written once and
  referred back to (LONG_BINGET) ever after, and each repetition makes its own frames lists, shared
  within it as the source shares them;
- every entry dict is new (memoized, never referred to again), the strings made per entry (such as
  compile_context 'N/A') are new each time, the cached ones (keys, actions, '') are referred back to.

So its pickle memo grows as a real long recording's does (about 2.7 slots per entry here, where
tile_snapshot.py's grows by 5). The file is written in one pass, a repetition at a time, from a
template of the unit's bytes with holes for what changes (addresses, times, memo indices): memory stays
that of the source. Pickle protocol 4 with 64 KiB-ish frames and batches of 1000, as pickle.dump writes.

--marks: user_metadata as our recorder writes it (`tracekit:iter=N:phase=P`, P the phase tracekit
infers for the source entry; the source's own trace is iteration 0, repetition r iteration r + 1), so
that `--iterations` windows are read in bounded memory; without it the file, like the source, has no
iteration marks (its iterations are then inferred from the stacks, which needs the whole trace).
--reuse-addresses K: repetition r uses the addresses of repetition r mod K (a caching allocator hands
the same blocks out again; every repetition frees all it allocates, so this is valid); 0 (default):
never, as tile_snapshot.py.
"""
from __future__ import annotations

import argparse
import os
import pickle
import struct
import sys
import time

FRAME_TARGET = 64 * 1024
BATCH = 1000


class _Restricted(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing global {module}.{name}")


def balanced_prefix(trace):
    """tile_snapshot.py's: the entries whose allocations are all freed within the trace."""
    live = {}
    keep = []
    for e in trace:
        a = e.get("action")
        if a == "alloc":
            live[e["addr"]] = True
            keep.append(e)
        elif a in ("free_requested", "free_completed"):
            if e["addr"] in live:
                keep.append(e)
                if a == "free_completed":
                    del live[e["addr"]]
    return [e for e in keep if e["addr"] not in live]


def encode_int(v: int) -> bytes:
    """As the C pickler writes an int (protocol 2+)."""
    if 0 <= v < 256:
        return b"K" + bytes((v,))
    if 0 <= v < 65536:
        return b"M" + struct.pack("<H", v)
    if -2**31 <= v < 2**31:
        return b"J" + struct.pack("<i", v)
    n = (v.bit_length() + 8) // 8  # pickle.encode_long: minimal two's complement, little-endian
    raw = v.to_bytes(n, "little", signed=True)
    if v < 0 and n > 1 and raw[-1] == 0xFF and raw[-2] & 0x80:
        raw = raw[:-1]
    if len(raw) > 255:
        raise ValueError("an integer too big for LONG1")
    return b"\x8a" + bytes((len(raw),)) + raw


def encode_str(s: str) -> bytes:
    b = s.encode("utf-8", "surrogatepass")
    if len(b) < 256:
        return b"\x8c" + bytes((len(b),)) + b
    if len(b) < 2**32:
        return b"X" + struct.pack("<I", len(b)) + b
    return b"\x8d" + struct.pack("<Q", len(b)) + b


def get(i: int) -> bytes:
    return b"h" + bytes((i,)) if i < 256 else b"j" + struct.pack("<I", i)


class Hole:
    """A part of a template filled in per repetition: ("addr" | "time" | "um", entry) or ("ref", k)."""
    __slots__ = ("what", "arg")

    def __init__(self, what, arg):
        self.what, self.arg = what, arg


class Writer:
    """A pickler of plain data that memoizes as CPython's does (by object identity), writing into
    `parts` (bytes and Holes). Objects in `local` (ids) are a repetition's own: memoized by their
    order in it (a Hole("ref", k) refers back to one), and forgotten after it."""

    def __init__(self):
        self.memo = {}  # id -> memo index, for objects of the whole file (kept alive in self.keep)
        self.keep = []
        self.n = 0  # memo slots so far
        self.parts = []
        self.local = None  # ids of a repetition's own objects -> their k, while writing a template
        self.local_ids = set()
        self.base = 0
        self.fresh_ids = set()  # ids of per-entry strings: written anew (memoized) each time

    def out(self, b):
        self.parts.append(b)

    def memoize(self, obj):
        if self.local is not None and id(obj) in self.local_ids:  # a repetition's own: its index varies
            rel = self.n - self.base
            self.local[id(obj)] = rel
            self.out(Hole("memo", rel))
        else:
            if self.local is None or id(obj) not in self.fresh_ids:
                assert self.local is None, "an object of the whole file met first in a repetition"
                self.memo[id(obj)] = self.n
                self.keep.append(obj)
            self.out(b"\x94")
        self.n += 1

    def ref(self, obj) -> bool:
        if self.local is not None and (id(obj) in self.local_ids or id(obj) in self.fresh_ids):
            rel = self.local.get(id(obj))
            if rel is None:
                return False
            self.out(Hole("ref", rel))
            return True
        i = self.memo.get(id(obj))
        if i is None:
            return False
        self.out(get(i))
        return True

    def save(self, obj):
        t = type(obj)
        if obj is None:
            return self.out(b"N")
        if t is bool:
            return self.out(b"\x88" if obj else b"\x89")
        if t is int:
            return self.out(encode_int(obj))
        if t is float:
            return self.out(b"G" + struct.pack(">d", obj))
        if self.ref(obj):
            return None
        if t is str:
            self.out(encode_str(obj))
            return self.memoize(obj)
        if t is tuple:
            if not obj:
                return self.out(b")")
            if len(obj) <= 3:
                for x in obj:
                    self.save(x)
                self.out(bytes((0x84 + len(obj),)))
            else:
                self.out(b"(")
                for x in obj:
                    self.save(x)
                self.out(b"t")
            return self.memoize(obj)
        if t is list:
            self.out(b"]")
            self.memoize(obj)
            return self.items(obj, b"a", b"e", lambda x: self.save(x))
        if t is dict:
            self.out(b"}")
            self.memoize(obj)
            return self.items(list(obj.items()), b"s", b"u", lambda kv: (self.save(kv[0]), self.save(kv[1])))
        raise TypeError(f"{t.__name__} is not plain data")

    def items(self, items, one, many, save):
        if len(items) == 1:
            save(items[0])
            return self.out(one)
        for i in range(0, len(items), BATCH):
            self.out(b"(")
            for x in items[i:i + BATCH]:
                save(x)
            self.out(many)
        return None

    def take(self):
        parts, self.parts = self.parts, []
        return parts


class Output:
    """The file, in frames (FRAME + length + whole opcodes), as protocol 4 writes it."""

    def __init__(self, path):
        self.f = open(path, "wb", buffering=16 << 20)
        self.f.write(b"\x80\x04")
        self.pending = []
        self.size = 0

    def write(self, b: bytes):
        self.pending.append(b)
        self.size += len(b)
        if self.size >= FRAME_TARGET:
            self.commit()

    def commit(self):
        if self.size:
            self.f.write(b"\x95" + struct.pack("<Q", self.size))
            self.f.writelines(self.pending)
        self.pending, self.size = [], 0

    def close(self):
        self.commit()
        self.f.close()


def fail(message):
    print(f"make_huge: {message}", file=sys.stderr)
    raise SystemExit(2)


def phase_names(source_path, trace_len):
    """Per entry of the source's device-0 trace, the phase tracekit finds for it (for --marks)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from tracekit.analysis.phases import PHASES, phases
    from tracekit.io import load

    t = load(source_path, use_cache=False)
    ph = phases(t)[t.devices[0]].phase
    assert len(ph) == trace_len
    return [PHASES[int(p)] for p in ph]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source")
    ap.add_argument("out")
    ap.add_argument("--entries", type=int, required=True)
    ap.add_argument("--marks", action="store_true", help="our recorder's iteration marks in user_metadata")
    ap.add_argument("--reuse-addresses", type=int, default=0, metavar="K")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.entries < 1:
        fail(f"--entries {args.entries}: expected a positive number of entries")
    if args.reuse_addresses < 0:
        fail(f"--reuse-addresses {args.reuse_addresses}: expected 0 (never) or a number of repetitions")
    try:
        with open(args.source, "rb") as f:
            snap = _Restricted(f).load()
    except Exception as e:  # any unreadable source: one line
        fail(f"{args.source}: not a readable snapshot pickle ({type(e).__name__}: {e})")
    if not isinstance(snap, dict) or not snap.get("device_traces") or not isinstance(snap["device_traces"][0], list):
        fail(f"{args.source}: not a snapshot with device traces")
    trace = snap["device_traces"][0]
    try:
        unit = balanced_prefix(trace)
    except (AttributeError, KeyError, TypeError) as e:
        fail(f"{args.source}: a trace entry of an unusual shape ({type(e).__name__}: {e})")
    if not unit:
        fail(f"{args.source}: no balanced alloc/free pairs on device 0")
    times = [e["time_us"] for e in unit if "time_us" in e]
    span = (max(times) - min(times) + 1) if times else 0
    reps = -(-args.entries // len(unit))
    step = 1 << 40
    if args.marks:
        names = phase_names(args.source, len(trace))
        phase_of = {id(e): names[i] for i, e in enumerate(trace)}
        for i, e in enumerate(trace):  # the source's own trace: iteration 0 (new dicts: the unit keeps its own)
            trace[i] = {**e, "user_metadata": f"tracekit:iter=0:phase={names[i]}"}

    # which objects of the unit are a repetition's own (new each time in a real recording), which are
    # the file's (torch's cached strings, frames deduplicated across the snapshot)
    refs = {}
    for e in unit:
        for v in e.values():
            refs[id(v)] = refs.get(id(v), 0) + 1
    w = Writer()
    for e in unit:
        w.local_ids.add(id(e))
        for k, v in e.items():
            if type(v) is list:  # a frames list: one per captured traceback (frame dicts are the file's)
                w.local_ids.add(id(v))
            elif type(v) is str and refs[id(v)] == 1 and k != "action":  # made per entry, e.g. 'N/A'
                w.fresh_ids.add(id(v))

    out = Output(args.out)
    keys = list(snap)
    w.out(b"}")
    w.memoize(snap)
    w.out(b"(")
    for k in keys:
        w.save(k)
        if k != "device_traces":
            w.save(snap[k])
            continue
        dts = snap[k]
        w.out(b"]")
        w.memoize(dts)
        if len(dts) > 1:
            w.out(b"(")
        for d, dt in enumerate(dts):
            if d > 0:
                w.save(dt)
                continue
            total = len(trace) + reps * len(unit)
            w.out(b"]")
            w.memoize(dt)
            if total > 1:
                w.out(b"(")
            for i, e in enumerate(trace):  # the source's own trace, as it is
                if i and i % BATCH == 0:
                    w.out(b"e(")
                w.save(e)
            for b in w.take():
                out.write(b)
            write_repetitions(w, out, unit, len(trace), reps, step, span, args, phase_of if args.marks else None)
            w.out(b"e" if total > 1 else b"a")
        if len(dts) > 1:
            w.out(b"e")
        else:
            w.out(b"a")
    w.out(b"u.")
    for b in w.take():
        out.write(b)
    out.close()
    n = len(trace) + reps * len(unit)
    print(f"{n} entries on device 0, {reps} repetitions, {os.path.getsize(args.out):,} bytes -> {args.out} "
          f"({time.perf_counter() - t0:.0f} s)")


def write_repetitions(w, out, unit, start, reps, step, span, args, phase_of):
    """The unit `reps` times after `start` entries of the device list, from one template."""
    # the template: each unit entry's parts, with holes for its address, time, metadata and local refs
    w.local = {}
    base = w.base = w.n
    templates, made_dicts = [], []
    for j, e in enumerate(unit):
        e2 = dict(e)
        if "addr" in e2:
            e2["addr"] = Hole("addr", j)
        if "time_us" in e2:
            e2["time_us"] = Hole("time", j)
        if phase_of is not None:
            e2["user_metadata"] = Hole("um", j)
        w.local_ids.add(id(e2))
        made_dicts.append(e2)
        w.out(b"}")
        w.memoize(e2)
        w.items(list(e2.items()), b"s", b"u", lambda kv: (w.save(kv[0]), w.out(kv[1]) if type(kv[1]) is Hole
                                                         else w.save(kv[1])))
        templates.append(_merge(w.take()))
    slots = w.n - base
    w.local = None
    addrs = [e.get("addr", 0) for e in unit]
    tus = [e.get("time_us", 0) for e in unit]
    phases = [phase_of[id(e)] if phase_of is not None else "" for e in unit]
    um_slots = 1 if phase_of is not None else 0  # each marked entry's user_metadata: a new memoized string
    g = start
    for r in range(reps):
        rbase = base + r * (slots + um_slots * len(unit))
        shift = ((r % args.reuse_addresses) if args.reuse_addresses else r) + 1
        made = 0  # user_metadata strings memoized so far in this repetition (they shift the local refs)
        local_at = {}
        chunk = []
        for j, parts in enumerate(templates):
            if g % BATCH == 0 and g:
                chunk.append(b"e(")
            g += 1
            for p in parts:
                if type(p) is bytes:
                    chunk.append(p)
                elif p.what == "addr":
                    chunk.append(encode_int(addrs[j] + shift * step))
                elif p.what == "time":
                    chunk.append(encode_int(tus[j] + r * span))
                elif p.what == "um":
                    chunk.append(encode_str(f"tracekit:iter={r + 1}:phase={phases[j]}") + b"\x94")
                    made += 1
                elif p.what == "memo":  # a local object memoized here: remember its index
                    local_at[p.arg] = rbase + p.arg + made
                    chunk.append(b"\x94")
                else:
                    chunk.append(get(local_at[p.arg]))
            if len(chunk) > 4096:
                out.write(b"".join(chunk))
                chunk = []
        if chunk:
            out.write(b"".join(chunk))
    w.n = base + reps * (slots + um_slots * len(unit))


def _merge(parts):
    """Adjacent bytes joined; a memoizing of a local object becomes a Hole("memo", k) (its index in the
    file depends on the repetition and on the metadata strings before it)."""
    out, buf = [], []
    for p in parts:
        if type(p) is bytes:
            buf.append(p)
        else:
            if buf:
                out.append(b"".join(buf))
                buf = []
            out.append(p)
    if buf:
        out.append(b"".join(buf))
    return out


if __name__ == "__main__":
    main()
