"""A window of a trace: entries `--from`/`--to`, the `--last 10s`, or `--iterations 3..5`.

`select(trace, window)` returns a new Trace holding only each device's entries
inside the window, renumbered from 0, as if the recording had covered only
that span. The memory live when the window opens is carried over from a replay
of the whole trace (meta "initial_allocated" / "initial_reserved"), so peaks
and timelines inside the window are the whole trace's; when the window ends
before the trace does, the final segments (the state at the end of the whole
trace) are dropped, since they do not describe the window's end; the replay
check against them is "not applicable" for a window.

A trace the streaming reader cut while reading (meta "streamed_window", see io/stream.py) holds
only the window's entries; `select` finishes it from the reader's per-device sums to the same
Trace as cutting the whole one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..errors import TracekitError

if TYPE_CHECKING:  # numpy, the model and the analysis are imported when a window is cut, so that parsing
    from ..model import Trace  # one (and a report served from the cache) stays light

_UNITS = {"us": 1, "ms": 1_000, "s": 1_000_000, "min": 60_000_000, "h": 3_600_000_000}


@dataclass(frozen=True)
class Window:
    """Entry range (inclusive, positions in each device's trace), last span in microseconds,
    and iteration range (inclusive); None means "no bound"."""

    first: int | None = None
    last: int | None = None
    last_us: int | None = None
    iterations: tuple[int, int] | None = None

    def __bool__(self):
        return any(v is not None for v in (self.first, self.last, self.last_us, self.iterations))

    def marked_ranges(self, first_pass) -> dict[int, tuple[int, int]] | None:
        """Per device list of the file (the scanner's "dl"), the entries [lo, hi) this window of
        iterations holds, as `ranges` finds them, from the streaming reader's pass that kept the runs of
        one user_metadata and the unmarked entries' times (io/stream.py's MARKS); None when a device's
        iterations are not our recorder's marks (inferred from the stacks, or none: the whole trace is needed)."""
        from ..model import NO_TIME
        from .phases import marked_iterations

        out = {}
        for f in first_pass.meta["streamed_window"].values():
            n = f["n"]
            if not n:
                continue
            starts, codes, texts, times = f["marks"]
            its = marked_iterations(starts, codes, texts, n, times, f["tmin"] != int(NO_TIME), first_pass.recorder)
            if its is None:
                return None
            lo = 0 if self.first is None else min(self.first, n)
            hi = n if self.last is None else min(n, self.last + 1)
            assert self.iterations is not None  # a streamed window is read by iterations only
            a, b = self.iterations
            spans = [(s, e) for i, s, e in its if a <= i <= b]
            lo, hi = (max(lo, spans[0][0]), min(hi, spans[-1][1] + 1)) if spans else (n, n)
            out[f["dl"]] = (lo, max(lo, hi))
        return out

    def describe(self) -> str:
        parts = []
        if self.first is not None or self.last is not None:
            parts.append(f"entries {'' if self.first is None else self.first}..{'' if self.last is None else self.last}")
        if self.last_us is not None:
            parts.append(f"the last {self.last_us / 1e6:g} s")
        if self.iterations is not None:
            a, b = self.iterations
            parts.append(f"iteration {a}" if a == b else f"iterations {a}..{b}")
        return ", ".join(parts)


def parse_duration(text: str) -> int:
    """'10s', '250ms', '2min', '1.5h', '500us' (a bare number is seconds) -> microseconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(us|ms|s|min|h)?\s*", text or "")
    if not m:
        raise ValueError(f"{text!r} is not a duration (expected e.g. 10s, 250ms, 2min)")
    us = round(float(m.group(1)) * _UNITS[m.group(2) or "s"])
    if us <= 0:
        raise ValueError(f"{text!r} is not a positive duration")
    return us


def parse_iterations(text: str) -> tuple[int, int]:
    """'3..5' -> (3, 5); '4' -> (4, 4)."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:\.\.\s*(\d+))?\s*", text or "")
    if not m:
        raise ValueError(f"{text!r} is not an iteration range (expected e.g. 3..5 or 4)")
    a, b = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
    if b < a:
        raise ValueError(f"iteration range {text!r} ends before it starts")
    return a, b


def ranges(trace: Trace, window: Window) -> dict[int, tuple[int, int]]:
    """Per device, the half-open range [lo, hi) of its entries (positions in its trace) inside the window."""
    import numpy as np

    from ..model import NO_TIME
    from .phases import phases

    out = {}
    ev = trace.events
    tmax = None
    if window.last_us is not None:
        t = ev.time_us[ev.time_us != NO_TIME]
        if not len(t):
            raise TracekitError(f"{trace.path}: it has no timestamps, so --last cannot pick a window "
                                "(use --from/--to entry numbers)")
        tmax = int(t.max())
    its = phases(trace) if window.iterations is not None else None
    for d in trace.devices:
        sl = ev.device_slice(d)
        n = sl.stop - sl.start
        lo, hi = 0, n
        if window.first is not None:
            lo = min(window.first, n)
        if window.last is not None:
            hi = min(hi, window.last + 1)
        if tmax is not None and window.last_us is not None:
            t = ev.time_us[sl]
            inside = np.flatnonzero((t != NO_TIME) & (t >= tmax - window.last_us))
            lo = max(lo, int(inside[0]) if len(inside) else n)
        if its is not None and window.iterations is not None:
            a, b = window.iterations
            spans = [(s, e) for i, s, e in its[d].iterations() if a <= i <= b]
            if its[d].source == "none":
                raise TracekitError(f"{trace.path}: no iterations are known on {trace.device_label(d)} "
                                    "(no recorder marks, metadata or optimizer steps), so --iterations cannot "
                                    "pick a window (use --from/--to or --last)")
            lo, hi = (max(lo, spans[0][0]), min(hi, spans[-1][1] + 1)) if spans else (n, n)
        out[d] = (lo, max(lo, hi))
    return out


def select(trace: Trace, window: Window) -> Trace:
    """The trace cut to `window` (see the module docstring); the trace itself when the window holds it all.

    Raises TracekitError (one line) when no entry of any device is inside the window."""
    import numpy as np

    from ..model import Blocks, Events, Segments
    from .replay import replay

    if "streamed_window" in trace.meta:
        return _finish(trace, window)
    if not window:
        return trace
    spans = ranges(trace, window)
    _check_not_empty(trace, window, spans)
    ev = trace.events
    if all((lo, hi) == (0, len(ev.action[ev.device_slice(d)])) for d, (lo, hi) in spans.items()):
        return trace  # the window holds the whole trace
    reps = replay(trace)
    keep = np.zeros(len(ev), bool)
    index = ev.index.copy()
    meta = dict(trace.meta)
    initial_allocated, initial_reserved = {}, {}
    to_end = True
    for d, (lo, hi) in spans.items():
        sl = ev.device_slice(d)
        keep[sl.start + lo:sl.start + hi] = True
        index[sl.start + lo:sl.start + hi] = np.arange(hi - lo)
        to_end &= hi == sl.stop - sl.start
        rep = reps[d]
        initial_allocated[d] = int(rep.allocated[lo - 1]) if lo else int(rep.initial_allocated)
        if rep.reserved is not None:
            initial_reserved[d] = int(rep.reserved[lo - 1]) if lo else int(rep.initial_reserved)
    events = Events(**{k: (index if k == "index" else getattr(ev, k))[keep] for k in Events.__dataclass_fields__})
    segments, blocks = trace.segments, trace.blocks
    if not to_end:  # the final segments describe the end of the whole trace, not of the window
        segments = Segments(**{k: v[:0] for k, v in vars(segments).items()})
        blocks = Blocks(**{k: v[:0] for k, v in vars(blocks).items()})
    # the whole trace's replay says what was live when the window opened (the final blocks would only
    # estimate it, at block rather than requested sizes)
    meta.update(has_segments=False, initial_allocated=initial_allocated, initial_reserved=initial_reserved)
    meta["window"] = {"description": window.describe(),
                      "devices": {d: [lo, hi, ev.device_slice(d).stop - ev.device_slice(d).start]
                                  for d, (lo, hi) in spans.items()}}
    why = _whole_why(trace, window)
    if why:  # a window a big file's read cannot pick alone (io/reading.py): said by read_note
        meta["window"]["read"] = {"only_window": False, "why": why}
    devices = sorted(set(np.unique(events.device).tolist()) | set(np.unique(segments.device).tolist()))
    return replace(trace, devices=devices, events=events, segments=segments, blocks=blocks, meta=meta)


def _whole_why(trace, window) -> str | None:
    """Why this window needs the whole trace (so a big file is read whole for it), or None."""
    if window.iterations is None:
        return None
    if window.last_us is not None:
        return "--iterations with --last is cut from the whole trace"
    from .phases import phases

    if any(p.source not in ("metadata", "recorder") for p in phases(trace).values() if p.n):
        return "its iterations are not marked by tracekit's recorder, so they are inferred from the whole trace"
    return None


def _check_not_empty(trace, window, spans):
    if all(lo >= hi for lo, hi in spans.values()):
        raise TracekitError(f"{trace.path}: no entries are inside the window ({window.describe()})")


# What a windowed read holds for each entry of the file beyond the window's own (the scanner's compact memo,
# the addresses freed in the trace, the runs of user_metadata): measured on make_huge.py's files (3.7
# memo slots and 0.06 new addresses per entry): report --json --no-cache --last 1s grows from 114 MiB at 10M
# entries to 611 MiB at 100M (README).
READ_BYTES_PER_ENTRY = 6


def read_note(cut: dict) -> str:
    """How a window was read, for the report's window line, `info` and the viewer ("" when the whole
    file was read and cut)."""
    read = cut.get("read") or {}
    if not read.get("only_window"):
        return f"the whole trace was read: {read['why']}" if read.get("why") else ""
    passes = "two passes over the file" if read.get("passes") == 2 else "one pass over the file"
    return (f"only its {read['kept_entries']:,} entries of the file's {read['file_entries']:,} were kept ({passes}, "
            f"the rest folded into a few sums per device): memory grows with the window, plus about "
            f"{read['held_bytes_per_file_entry']} bytes per entry of the file")


def _among(addr, touched):
    """Which of the (few) block addresses `addr` are in `touched` (the addresses a trace touches, as many
    as its allocations, unsorted): a pass over `touched` in pieces, so no copy of it is ever made."""
    import numpy as np

    keys, inverse = np.unique(addr, return_inverse=True)
    found = np.zeros(len(keys), bool)
    if len(keys):
        for i in range(0, len(touched), 1 << 20):
            part = touched[i:i + (1 << 20)]
            at = np.minimum(np.searchsorted(keys, part), len(keys) - 1)
            found[at[keys[at] == part]] = True
    return found[inverse.reshape(-1)]


def _finish(trace: Trace, window: Window) -> Trace:
    """`select` of a trace the streaming reader cut while reading (see the module docstring)."""
    import numpy as np

    from ..model import Blocks, Segments
    from .replay import LIVE_STATES

    meta = dict(trace.meta)
    folds = meta.pop("streamed_window")
    seg, blk = trace.segments, trace.blocks
    devices = sorted({d for d, f in folds.items() if f["n"]} | set(np.unique(seg.device).tolist()))
    n = {d: folds[d]["n"] if d in folds else 0 for d in devices}
    spans = {d: (folds[d]["lo"], folds[d]["lo"] + folds[d]["kept"]) if d in folds else (0, 0) for d in devices}
    _check_not_empty(trace, window, spans)
    if all(spans[d] == (0, n[d]) for d in devices):
        return replace(trace, meta=meta)  # the window holds the whole trace
    initial_allocated, initial_reserved = {}, {}
    live = np.isin(blk.state, LIVE_STATES)
    for d in devices:  # as replay() of the whole trace has it just before the window's first entry
        f = folds.get(d, {"cum_lo": 0, "rcum_lo": 0, "rcum": 0, "lone": 0, "touched": np.zeros(0, np.uint64)})
        mine = live & (blk.device == d)
        untouched = mine & ~_among(blk.addr, f["touched"])
        initial_allocated[d] = int(blk.size[untouched].sum()) + f["lone"] + f["cum_lo"]
        initial_reserved[d] = int(seg.total_size[seg.device == d].sum()) - f["rcum"] + f["rcum_lo"]
    if not all(spans[d][1] == n[d] for d in devices):  # the final segments: see select
        seg = Segments(**{k: v[:0] for k, v in vars(seg).items()})
        blk = Blocks(**{k: v[:0] for k, v in vars(blk).items()})
    meta.update(has_segments=False, initial_allocated=initial_allocated, initial_reserved=initial_reserved)
    meta["window"] = {"description": window.describe(),
                      "devices": {d: [lo, hi, n[d]] for d, (lo, hi) in spans.items()},
                      "read": {"only_window": True, "file_entries": sum(n.values()),
                               "kept_entries": sum(hi - lo for lo, hi in spans.values()),
                               "passes": 1 if window.last_us is None and window.iterations is None else 2,
                               "held_bytes_per_file_entry": READ_BYTES_PER_ENTRY}}
    ev = trace.events
    kept = sorted(set(np.unique(ev.device).tolist()) | set(np.unique(seg.device).tolist()))
    return replace(trace, devices=kept, segments=seg, blocks=blk, meta=meta)
