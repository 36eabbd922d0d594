"""What a simulated run writes: the snapshot `tracekit record` would have written of it (`-o FILE`).

PyTorch's format (segments from the allocator model, one trace per device with every request since the
start, frames, user_metadata phases) with our extras under the `tracekit` key (phases, iterations, tags)
and a category on each trace entry, exact from what the simulator knows of each storage: parameters,
buffers, gradients and optimizer state from the modules and optimizers it saw, forward storages alive
when backward begins are activations (autocast's weight copies included), cuBLAS workspaces are
`workspace`, the batch moved in is `input`, the rest temporary.
"""
from __future__ import annotations

import os

FORMAT = "tracekit-simulated-2"


def categories(session, infer=True) -> dict:
    """sid -> category: what the simulator knows (its tags: parameters, gradients, optimizer state; cuBLAS workspaces),
    and with `infer` the labels of the built-in training step (forward storages alive when backward begins are
    activations, autocast's weight copies parameters, the batch moved in an input). A script's run leaves those to
    tracekit's analysis, as for any recording (FSDP's unsharded units, DDP's buckets... by their frames)."""
    cat: dict = {}
    for kind, sid, name in session.tags:
        if sid is None or kind == "step":
            continue
        c = {"buffer": "parameter"}.get(kind, kind)
        if sid not in cat or (cat[sid] == "parameter" and c != "parameter"):
            cat.setdefault(sid, c)
    marks = session.marks
    starts: dict = {}
    for p in (marks.phases if marks is not None else []):
        if p["phase"] == "backward":
            starts.setdefault(p["iteration"], p["start_us"])
    for sid, info in session.info.items():
        if sid in cat or "merged_into" in info:
            continue
        if info.get("workspace"):
            cat[sid] = "workspace"
            continue
        if not infer:
            continue
        md = info.get("metadata", "") or ""
        dev = session.devices.get(info["device"])
        if md.endswith("phase=forward") and dev is not None:
            it = int(md.split("iter=")[1].split(":")[0])
            t0 = starts.get(it)
            fe = info.get("free_entry")
            freed_at = dev.entries[fe]["time_us"] if fe is not None and fe < len(dev.entries) else None
            if t0 is not None and (freed_at is None or freed_at > t0):
                cat[sid] = "activation"
                continue
        if info.get("weight_cast"):
            cat[sid] = "parameter"
            continue
        if not md and info.get("op") in ("_to_copy",) and not info.get("backward"):
            cat[sid] = "input"
    return cat


def snapshot(session, settings=None, extra=None, infer=False) -> dict:
    """The tracekit-format snapshot dict of the whole run (every device)."""
    import torch
    cat = categories(session, infer)
    by_entry = {}  # (device, entry index) -> category
    for sid, info in session.info.items():
        if "merged_into" in info:
            continue
        c = cat.get(sid, "temporary" if infer else "")
        by_entry[info["device"], info["entry"]] = c
        fe = info.get("free_entry")
        if fe is not None:
            by_entry[info["device"], fe - 1] = by_entry[info["device"], fe] = c
    traces: list
    traces, segments, tags = [], [], []
    for i in range(session.ndevices):
        d = session.devices.get(i)
        if d is None:
            traces.append([])
            continue
        out = []
        for k, e in enumerate(d.entries):
            e = dict(e)
            if e["action"] in ("alloc", "free_requested", "free_completed"):
                c = by_entry.get((i, k), "other" if infer else "")
                if c:
                    e["category"] = c
            out.append(e)
        traces.append(out)
        segments += d.segments()
    for kind, sid, name in session.tags:
        info = session.info.get(sid)
        if info is None or kind == "step":
            continue
        d = session.devices[info["device"]]
        e = d.entries[info["entry"]] if info["entry"] < len(d.entries) else None
        if e is None:
            continue
        tags.append({"addr": e["addr"], "size": info["size"], "device": info["device"], "time_us": e["time_us"],
                     "kind": kind, "name": name})
    marks = session.marks
    card = session.card
    sim = {"gpu": card.name, "compute_capability": list(card.sm), "total_memory": card.memory,
           "world_size": session.world_size, "rank": session.rank, "routing": session.routing,
           "alloc_conf": session.alloc_conf, "assumptions": session.summary_assumptions(),
           "sdpa_backends": dict(getattr(session.composites, "used", {}) or {}),
           "command": (settings or {}).get("command")}
    if extra:
        sim.update(extra)
    return {
        "segments": segments,
        "device_traces": traces,
        "allocator_settings": {"expandable_segments": bool(session.config.expandable_segments)},
        "tracekit": {
            "version": 1, "backend": "simulated", "format": FORMAT, "torch_version": str(torch.__version__),
            "devices": [{"index": i, "type": "cpu" if session.cpu_run else "cuda", "name": f"{card.device_name} (simulated)",
                         "total_memory": card.memory} for i in range(session.ndevices)],
            "phases": marks.phases if marks is not None else [],
            "iterations": marks.iterations if marks is not None else [],
            "tags": tags,
            "rank": session.rank, "world_size": session.world_size,
            "simulated": sim,
        },
    }


def write(session, path, settings=None) -> str:
    """Write the run to `path` (.rankN added under a world size above 1); returns the path written."""
    from ..io.write import write_snapshot
    if session.world_size > 1:
        root, ext = _split(path)
        path = f"{root}.rank{session.rank}{ext}"
    return write_snapshot(path, snapshot(session, settings))


def _split(path):
    for ext in (".pickle.gz", ".pkl.gz", ".json.gz", ".pickle", ".pkl", ".json"):
        if path.endswith(ext):
            return path[: -len(ext)], ext
    return os.path.splitext(path)
