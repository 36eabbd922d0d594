"""A quick first pass over a file before it is opened: how many entries, over what time, which
iterations, on which devices. Exact, from the columnar cache, when the file was opened before (the
key is found by the file's fingerprint, so nothing is hashed or parsed); otherwise estimated from the
file's size. The viewer's open dialog shows it to offer a window of a big file (analysis/window.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from . import cachefiles
from .analysis.units import fmt_bytes

# A pickled trace entry with a short Python stack takes about this many bytes (a 1M-entry tile of the
# real newest-format snapshot is 124 MB); a file with deeper stacks has fewer entries than estimated.
BYTES_PER_ENTRY = 124
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
        return None if self.first_us is None else (self.last_us - self.first_us) / 1e6


@dataclass
class Survey:
    path: str
    file_bytes: int
    exact: bool  # from the cache; else `entries` is an estimate and nothing else is known
    compressed: bool = False
    devices: list[DeviceSurvey] = field(default_factory=list)
    estimated_entries: int | None = None

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
                   else ", no iterations known")
            out.append(f"{d.label}: {d.entries:,} entries{span}{its}")
        return out


def survey(path) -> Survey:
    """The quick first pass over `path` (see the module docstring). Raises OSError if it cannot be read."""
    path = os.fsdecode(os.fspath(path))
    with cachefiles.open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        compressed = f.read(2) == GZIP_MAGIC
    key = cachefiles.known_key(path)
    trace = None
    if key:
        from .io import cache

        trace = cache.read(key, path)
    if trace is None:
        return Survey(path, size, False, compressed, estimated_entries=None if compressed else size // BYTES_PER_ENTRY)
    return Survey(path, size, True, compressed, devices=_devices(trace))


def _devices(trace) -> list[DeviceSurvey]:
    import numpy as np

    from .analysis.phases import phases
    from .model import NO_TIME

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
