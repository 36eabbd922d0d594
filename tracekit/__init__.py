"""tracekit: record, classify and explain PyTorch memory use.

`tracekit.load(path)` opens any memory file as a columnar `Trace`;
`tracekit.record(...)` (needs torch) records one. Importing tracekit imports
neither torch nor Qt.
"""
__version__ = "0.1.0"


def load(path, **kwargs):
    """Open a snapshot or profiler trace as a `tracekit.model.Trace`."""
    from .io import load as _load

    return _load(path, **kwargs)


def __getattr__(name):
    # The recorder needs torch: import it only when asked for.
    if name in ("record", "record_steps"):
        import importlib

        _record = importlib.import_module(".record", __name__)  # `from . import` would recurse here
        return getattr(_record, name)
    raise AttributeError(f"module 'tracekit' has no attribute {name!r}")
