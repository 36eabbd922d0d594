"""Progress while opening a file: a callback of (fraction, message).

The unpickler reads through `ProgressReader`, so progress (and cancellation:
a callback may raise `tracekit.errors.Cancelled`) works even inside one C call.
"""
from __future__ import annotations

import sys
import time


class ProgressReader:
    """Binary file wrapper that reports the share of `total` bytes read so far."""

    def __init__(self, raw, total, callback, position=None, span=(0.0, 1.0), message="reading"):
        self.raw = raw
        self.total = max(int(total), 1)
        self.callback = callback
        self.position = position or raw.tell  # where we are in the *file* (for gzip: compressed offset)
        self.span = span
        self.message = message
        self.last = 0.0

    def _report(self):
        now = time.monotonic()
        if now - self.last >= 0.05:
            self.last = now
            lo, hi = self.span
            self.callback(lo + (hi - lo) * min(self.position() / self.total, 1.0), self.message)

    def read(self, n=-1):
        data = self.raw.read(n)
        self._report()
        return data

    def readinto(self, buf):
        n = self.raw.readinto(buf)
        self._report()
        return n

    def readline(self, n=-1):
        data = self.raw.readline(n)
        self._report()
        return data

    def peek(self, n=0):
        return self.raw.peek(n)


class StderrProgress:
    """Callback that draws a one-line progress bar on stderr once `delay` seconds have passed.

    Only on a terminal: in a log or a pipe (stream not a tty) it writes nothing,
    so redraws never pile up in CI logs."""

    def __init__(self, label, delay=1.0, stream=None, clock=time.monotonic, interactive=None):
        self.label = label
        self.delay = delay
        self.stream = stream or sys.stderr
        self.clock = clock
        self.start = clock()
        self.shown = False
        if interactive is None:
            isatty = getattr(self.stream, "isatty", None)
            interactive = bool(isatty and isatty())
        self.interactive = interactive

    def __call__(self, fraction, message):
        if not self.interactive or self.clock() - self.start < self.delay:
            return
        self.shown = True
        width = 30
        done = int(width * fraction)
        self.stream.write(f"\r{self.label}: [{'#' * done}{'.' * (width - done)}] {fraction:4.0%} {message:<24}")
        self.stream.flush()

    def close(self):
        if self.shown:
            self.stream.write("\r" + " " * 80 + "\r")
            self.stream.flush()
