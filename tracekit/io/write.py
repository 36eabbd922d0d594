"""Write a snapshot dict atomically as a PyTorch-format pickle (protocol 4).

Only plain builtins are written (dict, list, tuple, str, int, float, bool,
None, bytes), so the file opens with a restricted unpickler that refuses
every global. Callers may add keys (our "tracekit" key, a "category" on each
entry) before writing; `write_snapshot` then makes the dict one that
pytorch.org/memory_viz renders (see memory_viz.py: it needs an "unknown"
category among the entries' categories), in place.
"""
from __future__ import annotations

import gzip
import io
import os
import pickle
import tempfile

PROTOCOL = 4


class _BuiltinsOnlyPickler(pickle.Pickler):
    # The C pickler handles exact builtins itself and calls reducer_override
    # only for other objects, so this check costs nothing on plain data.
    def reducer_override(self, obj):
        raise TypeError(
            f"a snapshot may hold only plain builtins, not {type(obj).__module__}.{type(obj).__qualname__}"
        )


def snapshot_bytes(snapshot) -> bytes:
    """The pickled bytes of `snapshot`; TypeError if it holds a non-builtin object."""
    buf = io.BytesIO()
    _BuiltinsOnlyPickler(buf, protocol=PROTOCOL).dump(snapshot)
    return buf.getvalue()


def write_snapshot(path, snapshot) -> str:
    """Write `snapshot` to `path` atomically (temp file in the same folder + os.replace).

    A path ending in ".gz" is gzip-compressed (memory_viz cannot open those).
    Returns the path written.
    """
    from .memory_viz import renderable

    path = os.fspath(path)
    data = snapshot_bytes(renderable(snapshot, repair_entries=False))
    if path.endswith(".gz"):
        data = gzip.compress(data, compresslevel=6)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path
