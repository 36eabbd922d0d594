"""Open files off the GUI thread, with progress and cancel.

The work runs in a plain Python thread that never touches Qt; a timer in the
GUI thread polls its progress and result and emits the signals. (Emitting Qt
signals from the worker while the GUI thread garbage-collects Qt wrappers can
deadlock PySide6 6.12 between the GIL and its own lock; this design has no
such window.) While any load runs, automatic garbage collection is paused, so
a collection the worker's allocations would trigger never destroys Qt objects
on the worker thread; it runs on the GUI thread when the loads are done.
"""
from __future__ import annotations

import gc
import threading

from PySide6.QtCore import QObject, QTimer, Signal

from tracekit.errors import Cancelled, TracekitError

from .document import Document

POLL_MS = 40
_running = 0  # loads in progress (GUI thread only)


def _pause_gc():
    global _running
    if _running == 0 and gc.isenabled():
        gc.disable()
    _running += 1


def _resume_gc():
    global _running
    _running -= 1
    if _running == 0:
        gc.enable()
        gc.collect()


class LoadThread(QObject):
    """Builds a `Document` for one path. Emits progress, then exactly one of loaded/failed/cancelled."""

    progress = Signal(float, str)
    loaded = Signal(object)  # Document
    failed = Signal(str)  # the user-facing message
    cancelled = Signal()

    def __init__(self, path, parent=None, use_cache=True):
        super().__init__(parent)
        self.path = str(path)
        self.use_cache = use_cache
        self._cancel = threading.Event()
        self._state = (0.0, "starting")  # (fraction, message): written by the worker, read by the timer
        self._shown = None
        self._outcome = None  # ("loaded", doc) | ("failed", message) | ("cancelled", None)
        self._finished = False
        self._thread = threading.Thread(target=self._work, name=f"tracekit-load {self.path}", daemon=True)
        self._timer = QTimer(self, interval=POLL_MS, timeout=self._poll)

    def start(self):
        _pause_gc()
        self._thread.start()
        self._timer.start()

    def cancel(self):
        self._cancel.set()

    def wait(self, timeout=None):
        """Block until the worker has finished (used when closing the window)."""
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._finish()

    def _finish(self):
        """Stop polling and let garbage collection run again (once)."""
        self._timer.stop()
        if not self._finished:
            self._finished = True
            _resume_gc()

    # ---- worker thread: no Qt here ----------------------------------------------------

    def _work(self):
        def progress(fraction, message):
            self._state = (fraction, message)

        try:
            doc = Document.open(self.path, progress=progress, cancelled=self._cancel.is_set,
                                use_cache=self.use_cache)
        except Cancelled:
            self._outcome = ("cancelled", None)
        except TracekitError as e:
            self._outcome = ("failed", str(e))
        except MemoryError:
            self._outcome = ("failed", f"cannot open {self.path}: out of memory while reading the file")
        except Exception as e:  # a bug in tracekit: say so rather than crash the viewer
            self._outcome = ("failed", f"cannot open {self.path}: internal error ({type(e).__name__}: {e}); "
                                       "please report this with the file")
        else:
            self._outcome = ("cancelled", None) if self._cancel.is_set() else ("loaded", doc)

    # ---- GUI thread ----------------------------------------------------------------------

    def _poll(self):
        state = self._state
        if state != self._shown:
            self._shown = state
            self.progress.emit(*state)
        if self._outcome is None or self._thread.is_alive():
            return
        self._finish()
        kind, value = self._outcome
        if kind == "loaded":
            self.loaded.emit(value)
        elif kind == "failed":
            self.failed.emit(value)
        else:
            self.cancelled.emit()
