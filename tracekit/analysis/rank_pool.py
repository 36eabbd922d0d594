"""Open a many-rank job: each rank's summary (read from beside its file, else computed in a process pool),
then one row per rank and the imbalance (ranks.py, pure functions over the summaries). What
`tracekit report DIR` and the viewer's rank dashboard call."""
from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

from ..errors import TracekitError
from ..io.rank_files import rank_files, read_summary
from .ranks import is_summary, rank_table

MEMORY_PER_FILE_BYTE = 8  # rough peak memory of opening a file, per byte of it (for sizing the pool)


def summarize_file(path: str, use_cache: bool = True, rules=None) -> tuple[dict | None, str | None]:
    """(summary, None), or (None, one line saying why the file could not be read)."""
    from ..io import load
    from .ranks import summarize

    try:
        return summarize(load(path, use_cache=use_cache), rules), None
    except TracekitError as e:
        return None, str(e)
    except Exception as e:  # an analysis bug on one rank must not lose the other rows
        return None, f"cannot analyse {path}: {type(e).__name__}: {e}"


def pool_size(paths: list[str], jobs: int | None = None) -> int:
    """Workers: the cores (or `jobs`), no more than the files, and no more than memory allows for the largest."""
    n = min(len(paths), jobs or os.cpu_count() or 1)
    try:
        largest = max(os.path.getsize(p) for p in paths)
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        n = min(n, max(1, avail // max(1, largest * MEMORY_PER_FILE_BYTE)))
    except (OSError, ValueError, AttributeError):
        pass
    return max(1, n)


def open_ranks(paths, jobs: int | None = None, use_summaries: bool = True, use_cache: bool = True,
               rules=None, with_curves: bool = False) -> dict:
    """rank_table of the files (folders expanded), with where each summary came from and what failed."""
    files = rank_files(paths)
    found = [read_summary(p) if use_summaries and rules is None else None for p in files]
    found = [s if is_summary(s) else None for s in found]
    todo = [i for i, s in enumerate(found) if s is None]
    errors = []
    workers = pool_size([files[i] for i in todo], jobs) if todo else 0
    if workers <= 1:
        results = [summarize_file(files[i], use_cache, rules) for i in todo]
    else:
        with ProcessPoolExecutor(workers, mp_context=_context()) as pool:
            results = list(pool.map(summarize_file, [files[i] for i in todo], [use_cache] * len(todo),
                                    [rules] * len(todo)))
    for i, (summary, error) in zip(todo, results):
        found[i] = summary
        if error:
            errors.append({"file": files[i], "error": error})
    ok = [i for i, s in enumerate(found) if s is not None]
    table = rank_table([s for s in found if s is not None], [files[i] for i in ok], with_curves)
    table.update(files=len(files), from_summaries=len(files) - len(todo), analysed=len(todo), workers=workers,
                 errors=errors)
    return table


def _context():
    """forkserver where there is one (safe beside threads, e.g. the viewer's), else spawn."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
