"""Signals: Ctrl-C and SIGTERM reach the script as they would without us, and leave a file.

Three pieces:

- `TermHandler` (the recording process): while recording, SIGTERM (a
  scheduler's time limit, `kill`) first writes what was recorded (marked
  partial), then the process dies of SIGTERM as it would have. Installed only
  where SIGTERM has its default action: a script's own handler is left alone.
  Ctrl-C needs no handler: KeyboardInterrupt unwinds through the recorder's
  ``__exit__`` (or the script runner), which writes the file.
- `deferred` (the recording process): while the file is written, SIGINT and
  SIGTERM wait; they are raised again once it is written. A second Ctrl-C
  during the write abandons it (nothing half-written is left: writes are atomic).
- `Forwarder` (the `tracekit record` parent): passes SIGINT, SIGTERM and SIGHUP
  on to the child, the way a terminal would, and never leaves the child a
  signal ignored that was not ignored before (the parent's handlers are
  Python functions, reset to the default action by exec).
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP")


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def exit_code(signum) -> int:
    """The shell's exit status for a process killed by `signum`."""
    return 128 + int(signum)


class TermHandler:
    """SIGTERM while recording: `on_signal(signum)` (writes the file), then die of the signal."""

    def __init__(self, on_signal):
        self.on_signal = on_signal
        self._installed = False
        self._busy = False

    def install(self):
        if not _main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def remove(self):
        if self._installed and _main_thread():
            self._installed = False
            if signal.getsignal(signal.SIGTERM) == self._handle:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def _handle(self, signum, frame):
        if self._busy:  # the same SIGTERM twice (sent to the process group and passed on by `tracekit
            return  # record`): dying now would lose the file being written; we die of it once it is written
        self._busy = True
        try:
            self.on_signal(signum)
        finally:
            self.remove()
            signal.signal(signum, signal.SIG_DFL)
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os.kill(os.getpid(), signum)


@contextlib.contextmanager
def deferred():
    """Hold SIGINT and SIGTERM while the body runs (the file is being written), then raise them again."""
    if not _main_thread():
        yield
        return
    pending = []

    def hold(signum, frame):
        pending.append(signum)
        if signum == signal.SIGINT:
            if pending.count(signal.SIGINT) > 1:
                raise KeyboardInterrupt
            print("tracekit: writing the recording (Ctrl-C again to abandon it)", file=sys.stderr, flush=True)

    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(signum)
        if handler not in (signal.SIG_IGN, None):
            previous[signum] = signal.signal(signum, hold)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(pending):
            if signum in previous and not (signum == signal.SIGINT and pending.count(signum) > 1):
                signal.raise_signal(signum)


@contextlib.contextmanager
def same_interrupt():
    """While a KeyboardInterrupt unwinds into our code: a SIGINT arriving now is the same Ctrl-C (a
    signal to the process group, passed on once more by `tracekit record`), not a new one that would
    abort writing the file. `deferred` still lets a Ctrl-C during the write abandon it."""
    if not _main_thread() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


class Forwarder:
    """In the parent: pass SIGINT, SIGTERM and SIGHUP on to the child process `proc`.

    A Ctrl-C typed at the terminal reaches the whole foreground process group,
    the child included: when we are that group, SIGINT is not sent again
    (the child would see two). Signals that were ignored stay ignored (the
    child inherits that, as it would have from the shell).
    """

    def __init__(self):
        self.proc = None
        self._previous = {}
        self._early = []  # signals that came before the child was started

    def started(self, proc):
        """The child runs: pass on what came while it was being started."""
        self.proc = proc
        for signum in self._early:
            self._handle(signum, None)
        self._early.clear()

    def __enter__(self):
        if _main_thread():
            for name in FORWARDED:
                signum = getattr(signal, name, None)
                if signum is None or signal.getsignal(signum) == signal.SIG_IGN:
                    continue
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
        return False

    def _handle(self, signum, frame):
        proc = self.proc
        if proc is None:
            self._early.append(signum)
            return
        if proc.poll() is not None:
            return
        if signum == signal.SIGINT and _terminal_foreground():
            return  # the terminal sent it to the child as well
        try:
            proc.send_signal(signum)
        except OSError:
            pass


def _terminal_foreground() -> bool:
    """Are we in the foreground process group of a controlling terminal?"""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | getattr(os, "O_NOCTTY", 0))
    except OSError:
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)
