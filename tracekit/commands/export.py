"""`tracekit export FILE`: the file as a snapshot pytorch.org/memory_viz renders, the allocations as a table."""
from __future__ import annotations

import os

import click

from ..errors import TracekitError
from ._common import file_argument, no_cache_option, open_trace, rules_option


@click.command("export")
@file_argument
@click.option("--memory-viz", "memory_viz", type=click.Path(dir_okay=False, path_type=str),
              help="Write a snapshot pickle that pytorch.org/memory_viz opens (categories as colours).")
@click.option("--allocations", type=click.Path(dir_okay=False, path_type=str),
              help="Write one row per allocation: .csv or .parquet (parquet needs pyarrow).")
@rules_option
@no_cache_option
def command(file, memory_viz, allocations, rules, no_cache):
    """Convert a memory FILE (snapshot, JSON, profiler trace, old formats) for other tools."""
    if not memory_viz and not allocations:
        raise click.UsageError("say what to write: --memory-viz OUT.pickle and/or --allocations OUT.csv|.parquet")
    for out in (memory_viz, allocations):
        if out and os.path.exists(out) and os.path.exists(file) and os.path.samefile(out, file):
            raise TracekitError(f"cannot write {out}: it is the input file")
    if allocations:
        ext = os.path.splitext(allocations)[1].lower()
        if ext not in (".csv", ".parquet"):
            raise TracekitError(f"cannot write {allocations}: the name must end in .csv or .parquet")
    if memory_viz and memory_viz.endswith(".gz"):
        raise TracekitError(f"cannot write {memory_viz}: memory_viz opens plain pickles only, not gzip")
    if memory_viz:
        from ..io.write import write_snapshot

        snap = memory_viz_snapshot(file, rules)
        _write(write_snapshot, memory_viz, snap)
        n = sum(len(t) for t in snap["device_traces"])
        click.echo(f"wrote {memory_viz}: {n:,} entries on {len(snap['device_traces'])} device(s), "
                   "open it at https://pytorch.org/memory_viz")
    if allocations:
        from ..analysis.tables import allocations_frame

        frame = allocations_frame(open_trace(file, no_cache), rules=rules)
        _write(_write_table, allocations, frame)
        click.echo(f"wrote {allocations}: {len(frame):,} allocations")


def memory_viz_snapshot(path, rules=None) -> dict:
    """The snapshot dict of any file tracekit opens, with our categories on its entries."""
    from ..analysis.categories import write_categories
    from ..errors import LoadError
    from ..io import read_document, to_trace
    from ..io.memory_viz import from_trace, has_categories, renderable
    from ..io.snapshot import SnapshotError, is_snapshot

    from ..io.progress import StderrProgress

    progress = StderrProgress(f"reading {path}")
    try:
        obj, _kind = read_document(path, progress)
    finally:
        progress.close()
    try:
        if is_snapshot(obj):
            snap = renderable(obj)
        else:
            from ..analysis.replay import replay

            trace = to_trace(obj, path)
            snap = from_trace(trace, {d: r.unattributed_bytes for d, r in replay(trace).items()})
        if rules or not has_categories(snap):
            write_categories(snap, rules)
        return snap
    except (SnapshotError, ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise LoadError(path, f"it cannot be converted ({type(e).__name__}: {e})") from None


def _write_table(path, frame):
    if path.lower().endswith(".parquet"):
        try:
            frame.to_parquet(path, index=False)
        except ImportError:
            raise TracekitError(f"cannot write {path}: parquet needs pyarrow (pip install pyarrow), "
                                "or write .csv") from None
    else:
        frame.to_csv(path, index=False)


def _write(fn, path, data):
    try:
        fn(path, data)
    except OSError as e:
        raise TracekitError(f"cannot write {path}: {e.strerror or e}") from None
