"""`tracekit whatif FILE --alloc-conf "expandable_segments:True,..."`: the same requests under other
caching-allocator settings (tracekit.analysis.allocator.settings_replay), as text (render/allocator.py) or JSON."""
from __future__ import annotations

from ..errors import TracekitError


def run(files, alloc_conf, start, device_memory, memory_limit, as_json, no_cache):
    from ..analysis.allocator.config import parse_alloc_conf
    from ..analysis.allocator.settings_replay import compare
    from ._common import open_trace, show

    config = parse_alloc_conf(alloc_conf)  # a bad setting fails before the file is read
    if len(files) != 1:
        raise TracekitError("whatif --alloc-conf takes one recording")
    trace = open_trace(files[0], no_cache)
    result = compare(trace, config, start=start, device_memory=device_memory, memory_limit=memory_limit)
    if not any(d.get("modelled") for d in result["devices"]):
        why = "; ".join(f"{d['label']}: {d['why']}" for d in result["devices"]) or "no device memory recorded"
        raise TracekitError(f"{files[0]}: the caching allocator cannot be modelled from this file ({why})")
    show("alloc_whatif", result, as_json)
