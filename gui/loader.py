"""Open files off the GUI thread, with progress and cancel."""
from __future__ import annotations

import threading

from PySide6.QtCore import QThread, Signal

from tracekit.errors import Cancelled, TracekitError

from .document import Document


class LoadThread(QThread):
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
        self._last = (-1.0, "")

    def cancel(self):
        self._cancel.set()

    def _progress(self, fraction, message):
        # Emit only visible changes: the reader may call this thousands of times.
        last_f, last_m = self._last
        if fraction - last_f >= 0.005 or message != last_m:
            self._last = (fraction, message)
            self.progress.emit(fraction, message)

    def run(self):
        try:
            doc = Document.open(self.path, progress=self._progress, cancelled=self._cancel.is_set,
                                use_cache=self.use_cache)
        except Cancelled:
            self.cancelled.emit()
        except TracekitError as e:
            self.failed.emit(str(e))
        except MemoryError:
            self.failed.emit(f"cannot open {self.path}: out of memory while reading the file")
        except Exception as e:  # a bug in tracekit: say so rather than crash the viewer
            self.failed.emit(f"cannot open {self.path}: internal error ({type(e).__name__}: {e}); "
                             "please report this with the file")
        else:
            if self._cancel.is_set():
                self.cancelled.emit()
            else:
                self.loaded.emit(doc)
