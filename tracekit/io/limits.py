"""Resource limits for opening untrusted files, each with an environment override.

A file must never make tracekit hang or exhaust the machine. Opening one is
bounded by:

- decompressed size: gzip data may expand at most $TRACEKIT_MAX_EXPANSION times
  (default 100; real snapshots expand 10-35x) and never past a quarter of the
  free memory; the stream is inflated in pieces and stops at the cap;
- memory: decoding and converting a file may use at most
  $TRACEKIT_MAX_MEMORY_MB (default: 32x the decoded size + 512 MiB, never more
  than the free memory). On Linux this is an address-space limit
  (RLIMIT_AS) held only while the file is read, so a pickle that asks for a
  16 GB memo fails at once, small;
- nesting: metadata nested deeper than $TRACEKIT_MAX_DEPTH (default 100) is refused;
- names: a frame's name or file name longer than MAX_NAME characters is cut to
  that length when the file is read (`cut_long_names`), so that no analysis of a
  name costs more than a bounded amount; the trace says how many were cut
  (meta["names_cut"]) and the commands print one warning line.

Per-file work is linear in the decoded size: shared frame lists are interned
once by identity (see columns.Interner), so no separate work limit is needed.
"""
from __future__ import annotations

import os
import reprlib
import sys
import threading
from contextlib import contextmanager

from ..errors import TracekitError

MiB = 2**20
MAX_NAME = 4096  # characters of a frame's name or file name (the longest real C++ names are about 2000)


class LimitExceeded(Exception):
    """A resource limit stopped reading a file; the message names the limit and its override."""


def env_number(name, default, minimum=0.0, integer=False):
    """A positive finite number from the environment, or `default`; TracekitError on anything else."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        value = None
    if value is None or value != value or value in (float("inf"), float("-inf")) or value < minimum \
            or value > 2**53:
        kind = "a whole number" if integer else "a number"
        raise TracekitError(f"{name}={raw!r} is not valid: expected {kind} >= {minimum:g}")
    return value


def max_expansion() -> float:
    return env_number("TRACEKIT_MAX_EXPANSION", 100.0, minimum=1.0)


def max_depth() -> int:
    return env_number("TRACEKIT_MAX_DEPTH", 100, minimum=1, integer=True)


def memory_override():
    """$TRACEKIT_MAX_MEMORY_MB in bytes, or None when unset."""
    mb = env_number("TRACEKIT_MAX_MEMORY_MB", None, minimum=1.0)
    return None if mb is None else int(mb * MiB)


def check_settings(use_cache=True) -> None:
    """Validate every TRACEKIT_* setting that opening a file reads, before any work is done."""
    max_expansion(), max_depth(), memory_override()
    if use_cache:
        env_number("TRACEKIT_CACHE_MAX_MB", 4096.0, minimum=0.0)


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None (unknown)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def decompressed_cap(file_bytes) -> tuple[int, str]:
    """(most bytes gzip data of a `file_bytes` file may expand to, why that number)."""
    ratio = max_expansion()
    cap = max(int(ratio * file_bytes), 64 * MiB)
    why = f"{ratio:g}x the file's size, TRACEKIT_MAX_EXPANSION"
    free = available_memory()
    if free is not None and cap > free // 4 and "TRACEKIT_MAX_EXPANSION" not in os.environ:
        cap, why = max(free // 4, MiB), "a quarter of the free memory"
    return cap, why


class CappedReader:
    """A binary stream that raises LimitExceeded once more than `cap` bytes were read from it."""

    def __init__(self, raw, cap, why):
        self.raw, self.cap, self.why, self.n = raw, cap, why, 0

    def _count(self, k):
        self.n += k
        if self.n > self.cap:
            raise LimitExceeded(f"its gzip data expands past {_mib(self.cap)} ({self.why}); a real snapshot "
                                "expands 10-35 times. If the file is genuine, raise TRACEKIT_MAX_EXPANSION")

    def read(self, n=-1):
        if n is None or n < 0:  # read in pieces so the cap stops a bomb before it is all in memory
            parts = []
            while True:
                chunk = self.read(4 * MiB)
                if not chunk:
                    return b"".join(parts)
                parts.append(chunk)
        data = self.raw.read(min(n, self.cap + 1 - self.n) if n > 0 else n)
        self._count(len(data))
        return data

    def readinto(self, buf):
        k = self.raw.readinto(buf)
        self._count(k or 0)
        return k

    def readline(self, n=-1):
        data = self.raw.readline(n if n is not None and n >= 0 else self.cap + 1 - self.n)
        self._count(len(data))
        return data

    def peek(self, n=0):
        return self.raw.peek(n)


# -- memory ------------------------------------------------------------------------------------------

_lock = threading.Lock()
_active: list = []  # budgets of the loads now holding the limit
_saved = None  # the soft RLIMIT_AS before the first of them


def memory_budget(decoded_bytes) -> tuple[int, str]:
    """(bytes a load of `decoded_bytes` may use, why that number)."""
    override = memory_override()
    if override is not None:
        return override, "TRACEKIT_MAX_MEMORY_MB"
    budget = 32 * int(decoded_bytes) + 512 * MiB
    free = available_memory()
    if free is not None and budget > free:
        return max(free, 256 * MiB), "the free memory"
    return budget, "32x the file + 512 MiB"


def _vm_size():
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


@contextmanager
def memory_limit(budget):
    """Hold an address-space limit of (current size + budget) while the block runs (Linux; elsewhere a no-op).

    Concurrent loads (the viewer opens files in threads) add their budgets; the
    last to finish puts the previous limit back."""
    global _saved
    if not sys.platform.startswith("linux"):
        yield
        return
    import resource

    base = _vm_size()
    if base is None:
        yield
        return
    with _lock:
        if not _active:
            _saved = resource.getrlimit(resource.RLIMIT_AS)
        _active.append(budget)
        _apply(resource, base + sum(_active))
    try:
        yield
    finally:
        with _lock:
            _active.remove(budget)
            if not _active:  # the last one out puts the previous limit back; others keep theirs
                try:
                    resource.setrlimit(resource.RLIMIT_AS, _saved)
                except (ValueError, OSError):
                    pass


def _apply(resource, limit):
    soft, hard = _saved
    if soft != resource.RLIM_INFINITY:
        limit = min(limit, soft)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ValueError, OSError):
        pass


def over_memory_message(budget, why) -> str:
    return (f"reading it needs more than {_mib(budget)} of memory ({why}). A corrupt or hostile file asks "
            "for that much; if the file is genuine, set TRACEKIT_MAX_MEMORY_MB higher")


# -- depth and text ----------------------------------------------------------------------------------

def check_depth(obj, what, limit=None):
    """Raise LimitExceeded if `obj` (plain data) nests deeper than the limit or contains itself.
    Iterative, so any depth is safe; a container shared by reference is walked once."""
    limit = max_depth() if limit is None else limit
    stack = [(obj, 1, False)]
    on_path, done = set(), set()
    while stack:
        o, d, leaving = stack.pop()
        if leaving:
            on_path.discard(id(o))
            done.add(id(o))
            continue
        if not isinstance(o, (dict, list, tuple, set, frozenset)) or id(o) in done:
            continue
        if id(o) in on_path:
            raise LimitExceeded(f"{what} contains itself; no memory snapshot does")
        if d > limit:
            raise LimitExceeded(f"{what} is nested more than {limit} levels deep (TRACEKIT_MAX_DEPTH); "
                                "no memory snapshot is")
        on_path.add(id(o))
        stack.append((o, d, True))
        items = list(o.keys()) + list(o.values()) if isinstance(o, dict) else o
        stack.extend((v, d + 1, False) for v in items)


_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother, _repr.maxlong = 3, 80, 80, 40


def text(v) -> str:
    """`v` as a short string: itself if a str, else a bounded repr (never deep, never huge)."""
    if type(v) is str:
        return v
    try:
        return _repr.repr(v)
    except Exception:  # a repr of hostile data must never fail a load
        return f"<{type(v).__name__}>"


def shown(v) -> str:
    """`v` for a message: a string quoted, anything else as `text` gives it."""
    return repr(v[:80] + "..." if len(v) > 80 else v) if type(v) is str else text(v)


def _mib(n) -> str:
    return f"{n / MiB:,.0f} MiB" if n >= MiB else f"{n:,} bytes"


def cut_long_names(trace) -> int:
    """Cut each frame name and file name longer than MAX_NAME characters to MAX_NAME (the first ones, then
    "..."), in place; meta["names_cut"] = how many strings were cut. Returns that number."""
    items = trace.strings.items
    long = [i for i, s in enumerate(items) if len(s) > MAX_NAME]
    if not long:
        return 0
    import numpy as np

    used = np.zeros(len(items), bool)
    for col in (trace.frames.filename, trace.frames.name):
        ids = col[(col >= 0) & (col < len(items))]
        used[ids] = True
    cut = [i for i in long if used[i]]
    if not cut:
        return 0
    for i in cut:
        items[i] = items[i][:MAX_NAME] + "..."
    trace.strings.index = {}
    for i, s in enumerate(items):  # the first id of a text, as interning gave it
        trace.strings.index.setdefault(s, i)
    trace.meta["names_cut"] = len(cut)
    return len(cut)


def names_cut_line(n) -> str | None:
    """The warning line for `n` long names cut (a count, or a trace whose meta says it; None when none were)."""
    if not isinstance(n, int):
        n = n.meta.get("names_cut")
    if not n:
        return None
    return (f"tracekit: warning: {n} frame name{'s' if n != 1 else ''} or file name{'s' if n != 1 else ''} "
            f"longer than {MAX_NAME} characters {'were' if n != 1 else 'was'} cut to {MAX_NAME}")
