"""What a fragmentation view shows, as plain data: the allocator's allocated and reserved bytes over the
trace, its segments and blocks at a chosen entry (the allocated peak by default) and the largest free block
there, and the same curves for other settings (a what-if). The viewer draws these; it computes nothing."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...model import Trace


@dataclass
class Fragmentation:
    device: int
    modelled: bool
    why: str | None = None
    exact: bool = False
    settings: str = ""
    allocated: np.ndarray | None = None  # int64 per entry: block bytes allocated after it
    reserved: np.ndarray | None = None  # int64 per entry
    initial_allocated: int = 0
    initial_reserved: int = 0
    peak_index: int = -1  # the allocated peak's entry
    index: int = -1  # the entry `segments` describe (the state just after it)
    segments: list[dict] = field(default_factory=list)  # [{address, total_size, blocks: [{address, size, state}]}]

    def _at(self, curve, initial, i):
        return initial if i < 0 or curve is None or len(curve) == 0 else int(curve[min(i, len(curve) - 1)])

    @property
    def allocated_at(self) -> int:
        return self._at(self.allocated, self.initial_allocated, self.index)

    @property
    def reserved_at(self) -> int:
        return self._at(self.reserved, self.initial_reserved, self.index)

    @property
    def unused_at(self) -> int:
        return self.reserved_at - self.allocated_at

    @property
    def largest_free(self) -> int:
        return max((b["size"] for s in self.segments for b in s["blocks"] if b["state"] == "inactive"), default=0)

    @property
    def free_blocks(self) -> int:
        return sum(1 for s in self.segments for b in s["blocks"] if b["state"] == "inactive")


def fragmentation(trace: Trace, device: int, index: int | None = None) -> Fragmentation:
    """The view's data for a device; `index`: the entry whose segments to show (default: the allocated peak)."""
    from .compiled import segments_at
    from .summary import allocator_replays, allocator_summary

    s = allocator_summary(trace, device)
    if not s["modelled"]:
        return Fragmentation(device, False, s["why"])
    r = allocator_replays(trace)[device]
    i = r.peak_index if index is None else int(index)
    return Fragmentation(device, True, s["why"], s["exact"], s["settings"], r.allocated, r.reserved,
                         r.initial_allocated, r.initial_reserved, r.peak_index, i, segments_at(trace, device, i))


def whatif_curves(trace: Trace, device: int, alloc_conf: str, start: str | None = None) -> dict:
    """The model's allocated and reserved bytes per entry under `alloc_conf` and under the recorded settings
    (same start), with the what-if summary (tracekit.analysis.allocator.settings_replay.compare's device entry)."""
    from .config import parse_alloc_conf
    from .model_replay import settings_of, total_memory
    from .summary import allocator_replays
    from .settings_replay import DEFAULT_START, device_limits, replay_under_settings

    start = start or DEFAULT_START  # the same start as `whatif --alloc-conf`
    config = parse_alloc_conf(alloc_conf)
    if "window" in trace.meta:
        from ...errors import TracekitError

        raise TracekitError("a what-if replays the whole recording: open the file without a window")
    recorded, _ = settings_of(trace)
    lim = device_limits(trace, device, allocator_replays(trace).get(device))
    kw = dict(recorded=recorded, start=start, capacity=lim["device_memory_bytes"],
              memory_fraction_bytes=lim["memory_limit_bytes"], total_memory=total_memory(trace, device), curves=True)
    base, what = replay_under_settings(trace, device, recorded, **kw), replay_under_settings(trace, device, config, **kw)
    return {"settings": config.describe(), "recorded_settings": recorded.describe(),
            "baseline": {"allocated": base.allocated, "reserved": base.reserved, "peak_reserved": base.peak_reserved,
                         "unused_at_peak": base.fragmentation_at_peak,
                         "largest_free_at_peak": base.largest_free_at_peak},
            "whatif": {"allocated": what.allocated, "reserved": what.reserved, "peak_reserved": what.peak_reserved,
                       "unused_at_peak": what.fragmentation_at_peak, "largest_free_at_peak": what.largest_free_at_peak,
                       "failed_requests": len(what.ooms)}}
