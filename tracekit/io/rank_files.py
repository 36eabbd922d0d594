"""The files of a many-rank job: finding them in a folder, and the small summary written beside each.

A summary is `<file>.summary.json` (see analysis/ranks.py for what it holds).
It names the file it summarises by a fingerprint (size and a hash of its
first and last 64 KiB), so a summary left beside a file recorded again, or
copied over, is not trusted; copying the folder keeps them valid.
"""
from __future__ import annotations

import hashlib
import json
import os
import re

from ..errors import LoadError

SUMMARY_SUFFIX = ".summary.json"
MEMORY_SUFFIXES = (".pickle", ".pkl", ".json", ".pickle.gz", ".pkl.gz", ".json.gz")
MAX_SUMMARY_BYTES = 16 << 20
_EDGE = 64 << 10


def summary_path(path) -> str:
    return os.fspath(path) + SUMMARY_SUFFIX


def fingerprint(path) -> str:
    """size:sha256 of the file's first and last 64 KiB (cheap on multi-GB files)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h = hashlib.sha256(f.read(_EDGE))
        if size > _EDGE:
            f.seek(max(_EDGE, size - _EDGE))
            h.update(f.read(_EDGE))
    return f"{size}:{h.hexdigest()}"


def write_summary(path, summary: dict) -> str:
    """Write `summary` beside the recording `path`, atomically; returns the summary's path."""
    out = summary_path(path)
    data = json.dumps({**summary, "fingerprint": fingerprint(path)}, separators=(",", ":")).encode()
    from .write import write_atomic

    write_atomic(out, data, sync=False)
    return out


def read_summary(path) -> dict | None:
    """The summary beside `path` if there is one and it still describes that file; else None (never raises)."""
    try:
        out = summary_path(path)
        if not os.path.isfile(out) or os.path.getsize(out) > MAX_SUMMARY_BYTES:
            return None
        with open(out, "rb") as f:
            obj = json.loads(f.read())
        if not isinstance(obj, dict) or obj.get("fingerprint") != fingerprint(path):
            return None
        return obj
    except (OSError, ValueError, RecursionError):
        return None


def is_memory_file(name: str) -> bool:
    n = name.lower()
    return n.endswith(MEMORY_SUFFIXES) and not n.endswith(SUMMARY_SUFFIX) and not n.startswith(".")


def rank_files(paths) -> list[str]:
    """The recordings among `paths`: files as given, folders expanded to their memory files (in natural order)."""
    out = []
    for p in map(os.fspath, paths):
        if os.path.isdir(p):
            names = sorted((n for n in os.listdir(p) if is_memory_file(n) and os.path.isfile(os.path.join(p, n))),
                           key=_natural)
            if not names:
                raise LoadError(p, f"the folder holds no recordings (files ending in {', '.join(MEMORY_SUFFIXES)})")
            out += [os.path.join(p, n) for n in names]
        else:
            out.append(p)
    return out


def _natural(name: str):
    """rank2 before rank10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
