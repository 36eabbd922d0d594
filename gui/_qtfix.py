"""Guard against a reference-counting bug of PySide6 6.12.0 on CPython < 3.12.

That release drops a reference to None every time a Qt method that returns
nothing is called (and to True/False in a few places). From Python 3.12 on
these objects are immortal and nothing happens; on 3.11 a viewer session dies
after a few thousand paints with "Fatal Python error: none_dealloc". The real
fix is a PySide6 other than 6.12.0 (see pyproject's gui extra); until then,
when the bug is detected, None, True and False get a reference count so large
that it can never reach zero (they are never freed anyway).
"""
from __future__ import annotations

import ctypes
import sys

PINNED = False


def _loses_none_refs() -> bool:
    from PySide6.QtCore import QObject

    probe = QObject()
    for _ in range(10):  # warm up: the first calls create cached objects that hold None
        probe.setObjectName("probe")
    before = sys.getrefcount(None)
    for _ in range(1000):
        probe.setObjectName("probe")
    return sys.getrefcount(None) < before - 500


def apply():
    global PINNED
    if PINNED or sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
        return
    if _loses_none_refs():
        for obj in (None, True, False):
            ctypes.c_ssize_t.from_address(id(obj)).value += 1 << 40
        PINNED = True


apply()
