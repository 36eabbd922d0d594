"""An independent, deliberately naive replay of snapshot dicts, used to check tracekit's.

Plain dicts and loops, written from DESIGN.md §4 without looking at
tracekit.analysis.replay: start from the blocks live in the final segments
that the trace never allocates, plus frees without an earlier alloc; apply
alloc (+size) and free_completed (-size).
"""


def block_addresses(segment):
    addr = segment["address"]
    for b in segment["blocks"]:
        yield b.get("address", addr), b
        addr = b.get("address", addr) + b["size"]


def naive_replay(snapshot, device=0):
    segments = snapshot if isinstance(snapshot, list) else snapshot["segments"]
    traces = [] if isinstance(snapshot, list) else snapshot.get("device_traces", [])
    trace = traces[device] if device < len(traces) else []
    final = {}
    for s in segments:
        if s.get("device", 0) != device:
            continue
        for addr, b in block_addresses(s):
            if b["state"] in ("active_allocated", "active_pending_free"):
                final[addr] = b["size"]
    seen, start = set(), 0
    for e in trace:
        if e["action"] == "alloc":
            seen.add(e["addr"])
        elif e["action"] == "free_completed" and e["addr"] not in seen:
            start += e["size"]  # allocated before the trace began
            seen.add(e["addr"])
    start += sum(size for addr, size in final.items() if addr not in seen)
    live, curve, total = {}, [], start
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
        elif e["action"] == "free_completed":
            total -= e["size"]
            live.pop(e["addr"], None)
        curve.append(total)
    peak = max(curve) if curve else start
    peak_index = curve.index(peak) if curve and peak >= start else -1
    reserved_end = sum(s["total_size"] for s in segments if s.get("device", 0) == device)
    return {"start": start, "peak": peak, "peak_index": peak_index, "final": curve[-1] if curve else start,
            "curve": curve, "reserved_end": reserved_end, "live_traced": live}
