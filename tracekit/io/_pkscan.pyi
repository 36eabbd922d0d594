"""Types of the compiled snapshot scanner (_pkscan.c; stream.py is its one caller)."""
from typing import Any, Callable

# (first entry, last entry + 1, thread's first time, the largest size kept, the latest time kept[, byte ranges, record])
Window = tuple[Any, ...]

def scan(read: Callable[[int], bytes], no_time: int, window: Window | None = ..., /) -> tuple[Any, ...]:
    """The columns and tape of a plain-data snapshot pickle read with read(n): the root, the strings, the keys, the
    devices, 28 byte buffers (the tape's nodes and edges, the entries' columns, the frame and stack tables), then, with
    a window, its folds (one dict per device list, with the addresses it touched, "touched", as uint64 bytes) and
    byte buffers: the address table's devices and addresses, the stacks and strings each device list uses, and with
    `record` the runs of one user_metadata (their strings and first positions) and the unmarked entries' times; then
    the number of rows of the entries' columns, the action codes' string ids (int32: code k is the action of id
    [k - 1]) and the bytes of one action code (1 below 256 codes, else 4) (45 items in all). An entries' column of
    one value throughout comes as that one value. ValueError('unsupported: ...') for anything but plain data."""

def scan_json(read: Callable[[int], bytes], no_time: int, window: Window | None = ..., /) -> tuple[Any, ...]:
    """The same of a snapshot written as JSON (UTF-8)."""
