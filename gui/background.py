"""A tab whose content is computed off the GUI thread (the comparison of two files, a folder of ranks).

As in loader.py: the worker is a plain Python thread that never touches Qt,
automatic garbage collection is paused while it runs, and a timer on the
GUI thread picks up its result and builds the widget that replaces the tab.
"""
from __future__ import annotations

import threading

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QLabel

from tracekit.errors import TracekitError

from .loader import _pause_gc, _resume_gc

POLL_MS = 50


class BackgroundTab(QLabel):
    """Shows `text` while `work()` runs; then `build(result)` becomes the tab (or the error is shown)."""

    def __init__(self, window, title, text, work, build):
        super().__init__(text)
        self.setAlignment(Qt.AlignCenter)
        self.window, self.title, self.work, self.build = window, title, work, build
        self.path = title
        self._outcome = None
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"tracekit {title}")
        self._timer = QTimer(self, interval=POLL_MS, timeout=self._poll)

    def start(self):
        index = self.window.tabs.addTab(self, self.title)
        self.window.tabs.setCurrentIndex(index)
        if self.window.tabs.indexOf(self.window.welcome) >= 0:
            self.window.tabs.removeTab(self.window.tabs.indexOf(self.window.welcome))
        self.window.threads[self] = self  # the window waits for it (screenshots, closing)
        _pause_gc()
        self._thread.start()
        self._timer.start()
        return self

    def _run(self):  # no Qt here
        try:
            self._outcome = ("ok", self.work())
        except TracekitError as e:
            self._outcome = ("failed", str(e))
        except MemoryError:
            self._outcome = ("failed", f"{self.title}: out of memory")
        except Exception as e:  # a bug: say so rather than crash the viewer
            self._outcome = ("failed", f"{self.title}: internal error ({type(e).__name__}: {e})")
        finally:
            _resume_gc()

    def cancel(self):
        """Nothing to interrupt: the result is dropped if the tab is gone by then."""

    def wait(self, timeout=None):
        self._thread.join(timeout)

    def _poll(self):
        if self._outcome is None or self._thread.is_alive():
            return
        self._timer.stop()
        self.window.threads.pop(self, None)
        index = self.window.tabs.indexOf(self)
        kind, value = self._outcome
        if index < 0:
            return
        if kind == "failed":
            self.window.tabs.removeTab(index)
            self.window._ensure_welcome()
            self.window.show_error("Cannot open", value)
            return
        widget = self.build(value)
        self.window.tabs.removeTab(index)
        self.window.tabs.insertTab(index, widget, self.title)
        self.window.tabs.setCurrentIndex(index)
        self.deleteLater()
