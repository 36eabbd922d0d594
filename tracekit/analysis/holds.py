"""What a rank of a sharded or data-parallel job holds at its peak, for the report and the rank table:
"rank 0 holds 1/2 of the parameters (1.8 MiB of 3.5 MiB); 3 units unsharded at the peak (1 prefetched)".

From the recorder's facts (record/distributed.py: strategy, world size, the model's full and local parameter
bytes, FSDP units) and the categories at the peak (`unsharded_parameter` tags name their unit; all-gather
outputs found by frames, not yet copied out, are units prefetched ahead of their compute).
"""
from __future__ import annotations

import numpy as np

from ..model import Trace
from .distributed import GATHER, UNSHARD, stack_roles


def fraction(part: float, whole: float) -> str:
    """"1/2", "1/8" when part is about whole / k for an integer k (within 2 %); else a percentage; "all"."""
    if not whole or part <= 0:
        return "none"
    k = whole / part
    if abs(k - 1) <= 0.02:
        return "all"
    r = round(k)
    if r >= 2 and abs(k - r) <= 0.02 * r:
        return f"1/{r}"
    return f"{part / whole:.1%}"


def rank_holds(trace: Trace, device: int, at_peak: dict, peak_index: int | None) -> dict | None:
    """What this rank holds at its peak, for the report: {"strategy", "world_size", "rank", "parameter_bytes"
    (the whole model's), "local_parameter_bytes" (this rank's: its shards, or everything when not sharded),
    "share" ("1/2"), "units" (FSDP units and their full bytes), "unsharded_units_at_peak" (how many units' full
    parameters are live at the peak), "prefetched_at_peak" (of them, gathered ahead: all-gather outputs not yet
    copied out), "summary"}. None when neither the recorder nor the stacks say the job was distributed."""
    from .categories import categorize, match_tags
    from .replay import replay

    rec = trace.recorder or {}
    info = dict(rec.get("distributed") or {})
    settings = rec.get("settings") or {}
    role, _ = stack_roles(trace)
    frames_say = bool((role > 0).any())
    if not info and not frames_say:
        return None
    world = info.get("world_size") or settings.get("world_size")
    rank = info.get("rank", settings.get("rank"))
    out = {"strategy": info.get("strategy") or ("sharded (by frames)" if (role == UNSHARD).any()
                                                 else "data parallel (by frames)"),
           "world_size": world, "rank": rank}
    for k in ("gradient_as_bucket_view", "bucket_bytes", "zero_stage", "sharding_strategy"):
        if k in info:
            out[k] = info[k]
    local = at_peak.get("parameter", 0)
    full = info.get("parameter_bytes")
    if info.get("local_parameter_bytes"):
        local = info["local_parameter_bytes"]
    units = info.get("units") or []
    out["units"] = units
    # each unit's all-gathered bytes as the recorder saw them (the parameter dtype of FSDP's mixed precision)
    out["unsharded_unit_bytes"] = {str(u.get("name")): int(u.get("bytes") or 0)
                                   for u in info.get("unsharded_units") or [] if isinstance(u, dict)}
    out["parameter_bytes"] = full
    out["local_parameter_bytes"] = int(local)
    out["share"] = fraction(local, full) if full else None
    # units unsharded at the peak: the units whose all-gathered parameters are live (our recorder's tags name the
    # unit; without them each unsharded allocation made by frames counts as its own unit), and, on top, units
    # prefetched: FSDP2 all-gather outputs live at the peak with no unsharded parameters made since (their copy-out
    # has not come yet); those bytes are in `communication`
    n_units = n_prefetch = prefetched_bytes = 0
    names = []
    rep = replay(trace)[device]
    al = rep.allocations
    if peak_index is not None and len(al):
        cats = categorize(trace)[device]
        live = al.live_at(peak_index)
        un_all = cats.labels == cats.names.index("unsharded_parameter")
        un = live & un_all
        sid = al.stack_id.astype(np.int64) + 1
        tags = [t for t in rec.get("tags") or [] if isinstance(t, dict) and t.get("kind") == "unsharded_parameter"
                and t.get("device", 0) == device]
        if un.any():
            rows = match_tags(trace, rep, tags) if tags else np.zeros(0, np.int64)
            for row, t in zip(rows.tolist(), tags):
                if row >= 0 and un[row]:
                    name = str(t.get("name", "")).removesuffix(" (unsharded)")
                    if name not in names:
                        names.append(name)
            n_units = len(names) if tags else int((un & (role[sid] == UNSHARD)).sum())
        gathers = np.flatnonzero(live & (role[sid] == GATHER) & (al.alloc_index >= 0))
        made = np.sort(al.alloc_index[un_all & (al.alloc_index >= 0)])
        for g in gathers.tolist():
            a = int(al.alloc_index[g])
            j = int(np.searchsorted(made, a, side="right"))
            if j >= len(made) or made[j] > peak_index:  # nothing copied out since this all-gather began
                n_prefetch += 1
                prefetched_bytes += int(al.size[g])
    out["unsharded_units_at_peak"] = n_units
    out["prefetched_at_peak"] = n_prefetch
    out["prefetched_bytes_at_peak"] = prefetched_bytes
    out["unsharded_names_at_peak"] = names
    out["unsharded_bytes_at_peak"] = int(at_peak.get("unsharded_parameter", 0))
    out["summary"] = holds_text(out)
    return out


def holds_text(h: dict) -> str:
    """"rank 0 holds 1/2 of the parameters (1.8 MiB of 3.5 MiB); 3 units unsharded at the peak (1 prefetched)"."""
    from ..units import fmt_bytes

    who = f"rank {h['rank']}" if h.get("rank") is not None else "this rank"
    full, local, share = h.get("parameter_bytes"), h.get("local_parameter_bytes") or 0, h.get("share")
    if full and share:
        what = ("all of the parameters" if share == "all" else f"{share} of the parameters")
        text = f"{who} holds {what} ({fmt_bytes(local)} of {fmt_bytes(full)})"
    else:
        text = f"{who} holds {fmt_bytes(local)} of parameters"
    n = h.get("unsharded_units_at_peak") or 0
    pre = h.get("prefetched_at_peak") or 0
    if n or h.get("unsharded_bytes_at_peak"):
        text += (f"; {n} unit{'s' if n != 1 else ''} unsharded at the peak "
                 f"({fmt_bytes(h.get('unsharded_bytes_at_peak') or 0)})")
    if pre:
        text += (f"{'' if n else ';'} + {pre} prefetched (all-gathered, not yet copied out: "
                 f"{fmt_bytes(h.get('prefetched_bytes_at_peak') or 0)} of communication)")
    if h.get("world_size"):
        text += f" [{h['strategy']}, {h['world_size']} ranks]"
    elif h.get("strategy"):
        text += f" [{h['strategy']}]"
    return text


def add_distributed(trace: Trace, devices: list):
    """Put "distributed" (what this rank holds, `rank_holds`) in each device's report dict, where it applies."""
    for d in devices:
        got = rank_holds(trace, d["device"], d.get("categories_at_peak") or {}, d.get("peak_event_index"))
        if got is not None:
            d["distributed"] = got
