"""Types of the compiled CPU hooks (_cpuhook.c): libc10's allocator calls (allochook.py) and the op log's hot path
(oplog.py's `Core`)."""
from types import FrameType
from typing import Any, Callable

def install(library_suffix: str, /) -> str | None:
    """Patch libc10's jump slots: None, or why not."""

def uninstall() -> None: ...
def start(capacity: int, /) -> None:
    """Record into a fresh ring of `capacity` events."""

def stop() -> None: ...
def release() -> None: ...
def track(pairs: bytes, /) -> None:
    """Record the frees of these storages: bytes of (pointer, size) pairs."""

def mark() -> int:
    """The index of the next event."""

def drain() -> tuple[bytes, int, int]:
    """(events as bytes, index of the first, how many were dropped)."""

def state() -> dict[str, Any]: ...

class Core:
    """The op log's hot path: every torch call from Python logged as a row of 12 int64."""

    on: int
    busy: int
    md_active: int
    op_names: int
    calls: int
    container: int
    limit: int
    setter: Any
    md_base: Any
    on_full: Any
    @property
    def op_funcs(self) -> list[Any]: ...
    def __init__(self, special: dict[Any, Any], mods: list[Any], ids: dict[Any, Any], parts: list[Any],
                 get_seq: Callable[[], int], use_mark: bool = ..., timed: bool = ...) -> None: ...
    def call(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None, /) -> Any: ...
    def append(self, row: Any, /) -> None: ...
    def take(self) -> bytes:
        """The rows so far as bytes of int64 (n x 12); emptied."""
    def rows(self) -> int: ...
    def stack_of(self, frame: FrameType, /) -> int: ...
