"""One rank of a multi-process job: once its file is written, a small summary beside it.

`tracekit report DIR` and the viewer's rank dashboard read these instead of
re-parsing every rank's (possibly multi-GB) file on one machine; each rank
computes its own, in parallel, at the end of recording. Written when the
launcher says there are several processes (WORLD_SIZE > 1, as torchrun
sets), or always with TRACEKIT_RANK_SUMMARY=1 (never with =0). The file is
opened without the columnar cache: hundreds of ranks must not fill a shared
home folder with caches. A failure is a warning: training goes on.
"""
from __future__ import annotations

import os
import warnings


def wanted() -> bool:
    flag = os.environ.get("TRACEKIT_RANK_SUMMARY", "").strip()
    if flag in ("0", "1"):
        return flag == "1"
    world = os.environ.get("WORLD_SIZE", "").strip()
    return world.isdigit() and int(world) > 1


def write_beside(recorder) -> str | None:
    """Summarise the recorder's written file into `<file>.summary.json`; returns its path (None: not written)."""
    path = recorder.written
    if not path or recorder.signal is not None or not wanted():  # a dying process writes nothing more
        return None
    try:
        from ..analysis.ranks import summarize
        from ..io import load
        from ..io.rank_files import write_summary

        summary = summarize(load(path, use_cache=False))
        world = os.environ.get("WORLD_SIZE", "").strip()
        summary["world_size"] = int(world) if world.isdigit() else None
        return write_summary(path, summary)
    except Exception as e:
        warnings.warn(f"tracekit: could not write the summary of {path} ({e!r})", RuntimeWarning)
        return None
