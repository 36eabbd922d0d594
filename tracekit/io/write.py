"""Write a snapshot dict atomically as a PyTorch-format pickle (protocol 4) or as JSON.

The name says the format: ``.pickle`` / ``.pkl`` (pickle), ``.json`` (the
same dict as JSON, as pytorch.org/memory_viz and tracekit also open), each
optionally ``.gz`` (memory_viz cannot open those); any other name is refused
(`output_format`). Only plain builtins are written (dict, list, tuple, str,
int, float, bool, None, bytes), so the file opens with a restricted
unpickler that refuses every global. Callers may add keys (our "tracekit"
key, a "category" on each entry) before writing; `write_snapshot` then makes
the dict one that pytorch.org/memory_viz renders (see memory_viz.py: it
needs an "unknown" category among the entries' categories), in place. Files
get the permissions the umask allows, as any file the user creates.
"""
from __future__ import annotations

import gzip
import io
import json
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


PICKLE_SUFFIXES = (".pickle", ".pkl")
JSON_SUFFIXES = (".json",)


def output_format(path):
    """("pickle" | "json", gzipped) from a file name; ValueError (one sentence) for any other name."""
    name = os.path.basename(os.fspath(path)).lower()
    gz = name.endswith(".gz")
    if gz:
        name = name[:-3]
    if name.endswith(PICKLE_SUFFIXES):
        return "pickle", gz
    if name.endswith(JSON_SUFFIXES):
        return "json", gz
    raise ValueError(f"cannot tell the format from the name {os.fspath(path)!r}: "
                     "end it in .pickle, .pkl or .json (optionally + .gz)")


def check_writable(path) -> None:
    """Raise ValueError (one sentence) unless a recording can be written to `path` now.

    The format must be known from the name, and the folder (or the nearest one
    that exists, for folders still to be made) must take a new file; `path`
    must not be a folder. Nothing is left behind.
    """
    path = os.path.abspath(os.fspath(path))
    output_format(path)
    if os.path.isdir(path):
        raise ValueError(f"{path} is a folder")
    folder = os.path.dirname(path)
    while not os.path.exists(folder):
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    if not os.path.isdir(folder):
        raise ValueError(f"{folder} is not a folder")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tracekit-check.", suffix=".tmp", dir=folder)
    except OSError as e:
        raise ValueError(f"cannot create a file in {folder} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(tmp)


def snapshot_json_bytes(snapshot) -> bytes:
    """`snapshot` as compact JSON (tuples become lists)."""
    return json.dumps(snapshot, separators=(",", ":")).encode()


def write_snapshot(path, snapshot) -> str:
    """Write `snapshot` to `path` atomically (temp file in the same folder + os.replace).

    The format follows the name (`output_format`). Returns the path written.
    """
    from .memory_viz import renderable

    path = os.fspath(path)
    fmt, gz = output_format(path)
    snapshot = renderable(snapshot, repair_entries=False)
    data = snapshot_bytes(snapshot) if fmt == "pickle" else snapshot_json_bytes(snapshot)
    if gz:
        data = gzip.compress(data, compresslevel=6)
    return write_atomic(path, data)


def write_atomic(path, data: bytes, sync=True) -> str:
    """Write `data` to `path` atomically: a temp file in the same folder, then os.replace.

    The file gets the permissions open() would give (0666 minus the umask);
    nothing is left behind on failure. Returns the path written."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes 0600: give what open() would
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def umask() -> int:
    """The process's umask, read without changing it where /proc tells it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
