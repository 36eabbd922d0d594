"""Open files off the GUI thread, with progress and cancel.

The work runs in a plain Python thread that never touches Qt; a timer in the
GUI thread polls its progress and result and emits the signals. (Emitting Qt
signals from the worker while the GUI thread garbage-collects Qt wrappers can
deadlock PySide6 6.12 between the GIL and its own lock; this design has no
such window.) While any load runs, automatic garbage collection is paused, so
a collection the worker's allocations would trigger never destroys Qt objects
on the worker thread; the worker turns it back on as it ends (even if its
window is gone), and the GUI thread collects once it sees the result.
"""
from __future__ import annotations

import gc
import threading

from PySide6.QtCore import QObject, QTimer, Signal

from tracekit.errors import Cancelled, TracekitError

from .document import Document

POLL_MS = 40
_lock = threading.Lock()
_running = 0  # loads in progress
_reenable = False  # whether automatic collection was on before the first load paused it


def _pause_gc():
    """Called on the GUI thread before a worker starts."""
    global _running, _reenable
    with _lock:
        if _running == 0:
            _reenable = gc.isenabled()
            gc.disable()
        _running += 1


def _resume_gc():
    """Called by each worker as it ends, whatever happens to its Qt side: the last one turns
    automatic collection back on (it does no collecting itself, so no Qt object dies off the GUI thread)."""
    global _running
    with _lock:
        _running -= 1
        if _running == 0 and _reenable:
            gc.enable()


class LoadThread(QObject):
    """Builds a `Document` for one path. Emits progress, then exactly one of loaded/failed/cancelled."""

    progress = Signal(float, str)
    loaded = Signal(object)  # Document
    failed = Signal(str)  # the user-facing message
    cancelled = Signal()

    def __init__(self, path, parent=None, use_cache=True, window=None):
        super().__init__(parent)
        self.path = str(path)
        self.use_cache, self.window = use_cache, window
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
        """Stop polling; collect what the load left behind, here on the GUI thread."""
        self._timer.stop()
        if not self._finished:
            self._finished = True
            gc.collect()

    # ---- worker thread: no Qt here ----------------------------------------------------

    def _work(self):
        def progress(fraction, message):
            self._state = (fraction, message)

        try:
            doc = Document.open(self.path, progress=progress, cancelled=self._cancel.is_set,
                                use_cache=self.use_cache, window=self.window)
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
        finally:
            _resume_gc()

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
