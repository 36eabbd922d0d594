"""A quick first pass over a file before it is opened: how many entries, over what time, which
iterations, on which devices. Exact, from the columnar cache, when the file was opened before (the
key is found by the file's fingerprint, so nothing is hashed or parsed); for a big file never opened,
from a pass of the compiled scanner that keeps no entry (entries and times exact; iterations those our
recorder marked, in user_metadata or its table); otherwise estimated from the file's size. The
viewer's open dialog shows it to offer a window of a big file (analysis/window.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..units import fmt_bytes
from ..io.cache import folder

# A pickled trace entry with a short Python stack takes about this many bytes (a 1M-entry tile of the
# real newest-format snapshot is 124 MB); a file with deeper stacks has fewer entries than estimated.
BYTES_PER_ENTRY = 124
SCAN_BYTES = 200 * 2**20  # a never-opened file this big (uncompressed, guessed) gets the scanner's pass
GZIP_MAGIC = b"\x1f\x8b"


@dataclass
class DeviceSurvey:
    label: str
    entries: int
    first_us: int | None = None  # the first and last time stamps (None: the entries have none)
    last_us: int | None = None
    iterations: tuple[int, int] | None = None  # the first and last iteration numbers known

    @property
    def seconds(self) -> float | None:
        return None if self.first_us is None or self.last_us is None else (self.last_us - self.first_us) / 1e6


@dataclass
class Survey:
    path: str
    file_bytes: int
    exact: bool  # from the cache or the scanner's pass; else `entries` is an estimate and nothing else is known
    compressed: bool = False
    devices: list[DeviceSurvey] = field(default_factory=list)
    estimated_entries: int | None = None
    scanned: bool = False  # exact from the scanner's pass: iterations it did not find may still be inferred

    @property
    def iterations_known(self) -> bool:
        """Whether the absence of iterations is known (not merely that none were marked)."""
        return self.exact and (self.iterations is not None or not self.scanned)

    @property
    def entries(self) -> int | None:
        return sum(d.entries for d in self.devices) if self.exact else self.estimated_entries

    @property
    def seconds(self) -> float | None:
        spans = [d.seconds for d in self.devices if d.seconds is not None]
        return max(spans) if spans else None

    @property
    def iterations(self) -> tuple[int, int] | None:
        known = [d.iterations for d in self.devices if d.iterations]
        return (min(a for a, _ in known), max(b for _, b in known)) if known else None

    def lines(self) -> list[str]:
        """What a person deciding how much of the file to open wants to know, one fact a line."""
        out = [f"{os.path.basename(self.path)}: {fmt_bytes(self.file_bytes)}"
               + (" (gzip-compressed)" if self.compressed else "")]
        if not self.exact:
            if self.estimated_entries is not None:
                out.append(f"about {self.estimated_entries:,} entries (estimated from the file's size; "
                           "not opened before)")
            else:
                out.append("not opened before: its size says little about a compressed file's entries")
            out.append("the time span and iterations are known once it has been opened")
            return out
        for d in self.devices:
            span = f", {d.seconds:.3f} s" if d.seconds is not None else ", no time stamps"
            its = (f", iterations {d.iterations[0]}..{d.iterations[1]}" if d.iterations
                   else ", no iterations marked (steps are found once it is opened)" if self.scanned
                   else ", no iterations known")
            out.append(f"{d.label}: {d.entries:,} entries{span}{its}")
        return out


def survey(path) -> Survey:
    """The quick first pass over `path` (see the module docstring). Raises OSError if it cannot be read."""
    path = os.fsdecode(os.fspath(path))
    with folder.open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        compressed = f.read(2) == GZIP_MAGIC
    key = folder.known_key(path)
    trace = None
    if key:
        from ..io.cache import traces

        trace = traces.read(key, path)
    if trace is None and size * (10 if compressed else 1) >= SCAN_BYTES:
        devices = _scanned(path)
        if devices is not None:
            return Survey(path, size, True, compressed, devices=devices, scanned=True)
    if trace is None:
        return Survey(path, size, False, compressed, estimated_entries=None if compressed else size // BYTES_PER_ENTRY)
    return Survey(path, size, True, compressed, devices=_devices(trace))


def _scanned(path) -> list[DeviceSurvey] | None:
    """The devices as the scanner's first pass sees them (None: it cannot read the file)."""
    from .phases import metadata_iteration
    from ..io.reading import first_pass
    from ..model import NO_TIME

    trace = first_pass(path)
    if trace is None:
        return None
    table = (trace.recorder or {}).get("iterations") or []
    out = []
    for d, f in sorted(trace.meta["streamed_window"].items()):
        if not f["n"]:
            continue
        timed = f["tmin"] != int(NO_TIME)
        its = [i for i in map(metadata_iteration, f["user_metadata"]) if i is not None and i >= 0]
        if not its and timed:  # the recorder's table: the iterations over this device's time span
            for r in table:
                try:
                    lo, hi, i = int(r["start_us"]), int(r["end_us"]), int(r.get("iteration", -1))
                except (KeyError, TypeError, ValueError):
                    continue
                if i >= 0 and lo <= f["tmax"] and hi > f["tmin"]:
                    its.append(i)
        out.append(DeviceSurvey(trace.device_label(d), f["n"], f["tmin"] if timed else None,
                                f["tmax"] if timed else None, (min(its), max(its)) if its else None))
    return out


def _devices(trace) -> list[DeviceSurvey]:
    import numpy as np

    from .phases import phases
    from ..model import NO_TIME

    its = phases(trace)
    out = []
    for d in trace.devices:
        sl = trace.events.device_slice(d)
        t = trace.events.time_us[sl]
        t = t[t != NO_TIME]
        known = [i for i, _, _ in its[d].iterations()] if its[d].source != "none" else []
        out.append(DeviceSurvey(trace.device_label(d), sl.stop - sl.start,
                                int(t.min()) if len(t) else None, int(np.max(t)) if len(t) else None,
                                (min(known), max(known)) if known else None))
    return out
