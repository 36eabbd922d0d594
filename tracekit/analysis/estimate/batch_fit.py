"""What-if: how the peak grows with the micro-batch (or sequence), what fits a budget, and the levers.

With two recordings at different sizes the fit is the line through what they needed. With one, the
categories say what grows: parameters, gradients, optimizer state and workspaces are fixed;
activations, inputs, temporaries and the KV cache grow with the batch. That is an extrapolation from
one point, so the answer is an interval: its high end is that split; at its low end the bytes of
unknown kind (other, a failed request) grow too and the allocator's reserved-but-unused memory at the
peak is kept. The fit follows every moment the file shows
(the peak, each phase's peak, the end, on every device) and takes the highest, so a peak that would
move elsewhere at another size is not missed.

A run that ran out of memory needed at least what was live when a request failed plus the request
(analysis/oom.py): that lower bound stands for its peak. The answer never contradicts the files: a
size that failed on a device with no more memory than the budget (or needs more than the budget even
at its lower bound) does not fit, nor does any larger size; a size a file ran within the budget fits.

The levers come from analysis/levers.py, the computation the report's advice uses: the same lever on
the same file saves the same bytes in both.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ...errors import TracekitError
from .memory import Setup

FIXED = ("parameter", "gradient", "optimizer_state", "workspace")
# a sharded / data-parallel rank's all-gathered units and collective buffers do not grow with the batch either
FIXED_DISTRIBUTED = ("unsharded_parameter", "communication")
SURE = ("activation", "input", "kv_cache")  # grow with the batch by what they are
LIKELY = ("temporary",)  # the brief's split counts them growing; some (an optimizer's foreach copies) do not
GROWING = SURE + LIKELY
# A budget up to this much above the memory of the device a run failed on counts as that device: budgets come in
# round numbers ("80GiB"), an 80 GB H100 holds 79.2 GiB.
DEVICE_MARGIN = 0.05


@dataclass
class Moment:
    """One moment of a recording the fit follows (the peak, a phase's peak, the end) on one device."""

    what: str
    bytes: int  # allocated then (at the peak of a run that ran out of memory: its demand, a lower bound)
    by_category: dict
    uncertain_extra: int = 0  # bytes of unknown kind on top of the categories (a failed request)
    fixed_extra: int = 0  # bytes of "other" known to be fixed (cuBLAS workspaces)


@dataclass
class Point:
    file: str
    size: int  # the micro-batch (or sequence length) of the recording
    peak: int  # peak allocated bytes (the device that needed the most)
    reserved: int | None  # peak reserved bytes, where the file has a caching allocator
    by_category: dict  # categories at the peak
    fragmentation: int = 0  # reserved but unallocated at the peak
    demand: int = -1  # what the run needed: the peak (-1: filled in with it), or after an out-of-memory error a lower bound
    lower_bound: bool = False
    failures: list = field(default_factory=list)  # [{"device", "available", "needed", "request", "limit"}]
    moments: list = field(default_factory=list)  # [Moment]
    device: str = ""
    workload: str = "training"

    def __post_init__(self):
        if self.demand is None or self.demand < 0:
            self.demand = self.peak
        if not self.moments:
            self.moments = [Moment("the peak", self.demand, dict(self.by_category),
                                   uncertain_extra=max(0, self.demand - self.peak))]

    def to_dict(self) -> dict:
        out = {k: v for k, v in vars(self).items() if k != "moments"}
        out["moments"] = [vars(m) for m in self.moments]
        return out


def point_from_report(path: str, report: dict, size: int) -> Point:
    """A Point from one file's report (analysis.report.build_report): every device's moments, the device that
    needed the most, and each out-of-memory error with the memory the allocator could have had then."""
    from ..oom import available_when_failed

    devices = [d for d in report["devices"] if d.get("peak_allocated_bytes") is not None]
    if not devices:
        raise TracekitError(f"{path}: no device memory recorded")
    main = max(devices, key=lambda d: _demand(d))
    moments = []
    for d in devices:
        label = d["label"]
        peak = _peak(d)
        demand = _demand(d)
        workspace = sum(r["bytes"] for r in d.get("reasons_at_peak") or []
                        if r["category"] == "other" and "workspace" in r["reason"].lower())
        moments.append(Moment(f"{label} peak" + (" (needed, a lower bound)" if demand > peak else ""), demand,
                              dict(d.get("categories_at_peak") or {}), uncertain_extra=demand - peak,
                              fixed_extra=workspace))
        for ph in d.get("phases") or []:
            moments.append(Moment(f"{label} {ph['phase']} peak", ph["peak_bytes"], dict(ph.get("categories_at_peak") or {})))
        if d.get("final_allocated_bytes") is not None and d.get("categories_at_end"):
            moments.append(Moment(f"{label} end", d["final_allocated_bytes"], dict(d["categories_at_end"])))
    failures = []
    for f in report["findings"]:
        if f["kind"] == "oom":
            o = {"reserved_bytes": f.get("reserved_bytes"), "device_free_bytes": f.get("device_free_bytes"),
                 "limit_bytes": f.get("limit_bytes"), "total_bytes": f.get("total_bytes")}
            failures.append({"device": f.get("label") or f["device"], "available": available_when_failed(o),
                             "needed": f.get("needed_bytes") or f.get("allocated_bytes"),
                             "request": f.get("request_bytes"), "limit": f.get("limit_bytes")})
    reserved = main.get("peak_reserved_bytes") if main["label"] != "cpu" else None
    frag = main.get("fragmentation_at_peak_bytes") if main["label"] != "cpu" else 0
    return Point(path, int(size), int(_peak(main)), reserved,
                 dict(main.get("categories_at_peak") or {}), max(int(frag or 0), 0),
                 demand=int(_demand(main)),
                 lower_bound=bool(main.get("demand_is_lower_bound")), failures=failures, moments=moments,
                 device=main["label"])


def _peak(d: dict) -> int:
    """A device's peak as the report's headline states it (the allocator's counter where modelled, issue 31)."""
    return (d.get("headline_peak") or {}).get("bytes") or d["peak_allocated_bytes"]


def _demand(d: dict) -> int:
    """What the device needed: its headline peak, or after an out-of-memory error the demand (a lower bound)."""
    return (d.get("demand_bytes") or _peak(d)) if d.get("demand_is_lower_bound") else _peak(d)


def _slopes(m: Moment, size: int) -> tuple[float, float, float]:
    """(low, middle, high) bytes per unit of size for one moment (see the module's doc)."""
    cats = m.by_category
    sure = sum(cats.get(c, 0) for c in SURE)
    likely = sum(cats.get(c, 0) for c in LIKELY)
    unknown = sum(v for c, v in cats.items()
                  if c not in FIXED and c not in FIXED_DISTRIBUTED and c not in GROWING) - m.fixed_extra
    unknown = max(0, unknown) + m.uncertain_extra
    return sure / size, (sure + likely) / size, (sure + likely + unknown) / size


def fit(points: list[Point], by="batch") -> dict:
    """{fixed_bytes, per_unit_bytes (the middle), per_unit_range, method, extrapolation, lines, assumptions}:
    peak ≈ fixed + per_unit × size, on the moment that needs the most."""
    notes = []
    lower = [p for p in points if p.lower_bound]
    if len(points) >= 2:
        a, b = sorted(points[:2], key=lambda p: p.size)
        if a.size == b.size:
            raise TracekitError(f"both recordings have {by} {a.size}: what-if needs two different sizes")
        per = (b.demand - a.demand) / (b.size - a.size)
        fixed = a.demand - per * a.size
        lines: list[dict[str, Any]] = [{"what": "the line through the two recordings", "at": a.size, "bytes": a.demand,
                  "per": [per, per, per]}]
        method = f"the line through two recordings ({by} {a.size} and {b.size})"
        if by == "seq":
            notes.append("eager attention scores grow with seq²: a line through two sequence lengths "
                         "underestimates beyond them")
        if per < 0:
            notes.append("the larger recording needed less than the smaller: the two are not the same setup, or "
                         "the peak is noise; the line is not a prediction")
        if lower:
            notes.append(f"{', '.join(p.file for p in lower)} ran out of memory: its need is a lower bound, and so "
                         "is the fit there")
        return {"fixed_bytes": int(fixed), "per_unit_bytes": int(per), "per_unit_range": [int(per), int(per)],
                "method": method, "by": by, "extrapolation": False, "lines": lines, "assumptions": notes}
    p = points[0]
    lines = []
    for m in p.moments:
        lo, mid, hi = _slopes(m, p.size)
        lines.append({"what": m.what, "at": p.size, "bytes": int(m.bytes), "per": [lo, mid, hi]})
    main = lines[0]
    lo, mid, hi = main["per"]
    fixed = main["bytes"] - mid * p.size
    growing = ", ".join(GROWING)
    fixed_names = FIXED + tuple(c for c in FIXED_DISTRIBUTED if p.moments and p.moments[0].by_category.get(c))
    method = (f"one recording's categories at its peak ({growing} grow with the {by}; "
              f"{', '.join(fixed_names)} are fixed)")
    notes.append(f"an extrapolation from one recording ({by} {p.size}): {_mib(mid)} per {by} by the categories' "
                 f"split, {_mib(hi)} if the bytes of unknown kind grow too (only what surely grows, activations, "
                 f"inputs and KV cache: {_mib(lo)}), so the answer is an interval; record a second size to measure it")
    if p.lower_bound:
        notes.append(f"{p.file} ran out of memory: the fit starts from what it needed at least "
                     f"({_mib(p.demand)}), a lower bound")
    if by == "seq":
        notes.append("eager attention scores grow with seq²: a line underestimates longer sequences")
    notes.append("peak allocated bytes; the CUDA context and the allocator's reserve come on top")
    return {"fixed_bytes": int(fixed), "per_unit_bytes": int(mid), "per_unit_range": [int(lo), int(hi)],
            "method": method, "by": by, "extrapolation": True, "lines": lines, "assumptions": notes}


def _mib(n) -> str:
    from ...units import fmt_bytes

    return fmt_bytes(n)


def _largest_on(lines, budget, k) -> float:
    """The largest size whose predicted need on every line (slope k of each) is within `budget` (inf: no limit)."""
    best = math.inf
    for ln in lines:
        per = ln["per"][k]
        if per <= 0:
            if ln["bytes"] > budget:
                return -math.inf if per == 0 else min(best, ln["at"] + math.floor((budget - ln["bytes"]) / per))
            continue
        best = min(best, ln["at"] + math.floor((budget - ln["bytes"]) / per))
    return best


def largest_fitting(f: dict, budget: int, headroom: int = 0) -> int | None:
    """The largest size whose fitted need (+ headroom) is within budget, by the middle slope; None when the
    need does not grow."""
    got = _largest_on(f["lines"], budget - headroom, 1)
    if got == math.inf:
        return None
    return max(0, int(got)) if got != -math.inf else 0


def answer(points: list[Point], f: dict, budget: int) -> dict:
    """{"largest", "range": [low, high], "estimate", "constraints": [...], "grows": bool}: the largest size
    within `budget`, as an interval, made consistent with what the files show."""
    cons = []
    # the interval follows the fit's own slope range (per_unit_range: only what surely grows, ..., with the bytes
    # of unknown kind growing too), each with and without the reserved-but-unused bytes kept (issue 31)
    k_sets = [0, 1, 2]
    reserve = max((p.fragmentation for p in points), default=0)
    tries = []
    for k in k_sets:
        for b in (budget, budget - reserve):
            tries.append(_largest_on(f["lines"], b, k))
    lo: Any  # sizes, or None where the fit does not bound them
    hi: Any
    mid: Any = _largest_on(f["lines"], budget, 1)
    grows = any(v != math.inf for v in tries)
    if not grows:
        lo = hi = mid = None
    else:
        lo, hi = _size(min(tries)), _size(max(tries))
        mid = _size(mid)
        if f["extrapolation"] is False:
            lo = hi = mid
        if mid is None:  # the middle slope does not grow: the interval's low end is the safe answer
            mid = lo if lo is not None else 0
    # what the files show: a size that ran within the budget fits; one that failed with no more memory than the
    # budget (or needing more than the budget even at its lower bound) does not, nor does anything larger
    from ...units import fmt_pair

    for p in points:
        if p.failures:
            worst = None
            for fl in p.failures:
                avail = fl.get("available")
                if ((avail is not None and budget <= avail * (1 + DEVICE_MARGIN)) or (fl.get("needed") or 0) > budget
                        or p.demand > budget):
                    worst = fl
            if worst is not None:
                cap = p.size - 1
                avail = worst.get("available")
                need_s, avail_s = fmt_pair(p.demand, avail) if avail is not None else (_mib(p.demand), None)
                what = (f"{p.file} ran out of memory at {f['by']} {p.size} on {worst['device']}"
                        + (f" with {avail_s} available" if avail_s else "")
                        + f" (it needed at least {need_s}): {f['by']} {p.size} and above do not fit "
                          f"{fmt_pair(budget, p.demand)[0]}")
                cons.append({"kind": "failed", "file": p.file, "size": p.size, "text": what})
                lo, hi, mid = (cap if x is None else min(x, cap) for x in (lo, hi, mid))
                lo, hi, mid = (max(0, x) for x in (lo, hi, mid))
            else:
                cons.append({"kind": "failed elsewhere", "file": p.file, "size": p.size,
                             "text": f"{p.file} ran out of memory at {f['by']} {p.size} on a device with less memory "
                                     f"than {_mib(budget)}; its need is a lower bound, so {f['by']} {p.size} and above "
                                     "may not fit either"})
        else:
            shown = p.reserved if p.reserved is not None else p.peak
            if shown <= budget:
                cons.append({"kind": "ran", "file": p.file, "size": p.size,
                             "text": f"{p.file} ran at {f['by']} {p.size} within {_mib(budget)} "
                                     f"({'reserved' if p.reserved is not None else 'allocated'} {_mib(shown)})"})
                if lo is not None:
                    lo, mid = max(lo, p.size), max(mid, p.size)
                    hi = None if hi is None else max(hi, mid)
    if any(p.lower_bound for p in points) and lo is not None:
        cons.append({"kind": "upper bound", "file": "", "size": None,
                     "text": "a run that ran out of memory shows only a lower bound of its need: the sizes above "
                             "are the most that can fit, not a promise"})
    if lo is not None:
        if hi is not None:
            lo, hi = min(lo, hi), max(lo, hi)
            mid = min(max(mid, lo), hi)
        else:
            mid = max(mid, lo)
    return {"largest": lo, "range": None if lo is None else [lo, hi], "estimate": mid, "constraints": cons,
            "grows": grows}


def _size(x) -> int | None:
    """A size from `_largest_on`: None for no limit, 0 when even the smallest does not fit."""
    if x == math.inf:
        return None
    return 0 if x == -math.inf else max(0, int(x))


def levers(facts: dict, at_peak: dict, need: int, budget: int, fragmentation: int = 0, spikes=(), dp=None,
           lower_bound: bool = False, peak: int | None = None) -> list[dict]:
    """The levers (analysis/levers.py), each with what the need would be after it and whether that fits."""
    from ..levers import levers as all_levers

    out = []
    for lv in all_levers(facts, at_peak, peak if peak is not None else need, fragmentation, spikes, dp):
        after = need if lv.get("reserved_only") else need - lv["saves_bytes"]
        fits = after <= budget
        text = ("over budget" if not fits else "fits?" if lower_bound else "fits")
        out.append({**lv, "peak_after": int(after), "fits": bool(fits and not lower_bound), "fits_text": text})
    return out


def fit_to_budget(points: list[Point], budget: int, by="batch", facts: dict | None = None,
                  lever_input: dict | None = None, setup: Setup | None = None, not_offered=()) -> dict:
    """The fit, the largest size within `budget` (an interval), the constraints the files set, and the levers."""
    if not points:
        raise TracekitError("what-if needs at least one recording")
    if budget <= 0:
        raise TracekitError("--budget must be above zero")
    f = fit(points, by)
    got = answer(points, f, budget)
    largest = got["largest"]
    peak_at = None
    if largest is not None:
        peak_at = max(int(ln["bytes"] + ln["per"][1] * (largest - ln["at"])) for ln in f["lines"])
    biggest = max(points, key=lambda p: p.size)
    result = {"points": [p.to_dict() for p in points], "budget": int(budget), "fit": f,
              f"largest_{by}": largest, f"largest_{by}_range": got["range"], f"largest_{by}_estimate": got["estimate"],
              "grows": got["grows"], "constraints": got["constraints"],
              "peak_at_largest": peak_at, "levers": [], "levers_assumptions": [], "levers_not_offered": list(not_offered)}
    if facts is not None and lever_input is not None:
        result["levers"] = levers(facts, lever_input["at_peak"], biggest.demand, budget,
                                  lever_input.get("fragmentation", 0), lever_input.get("spikes", ()),
                                  lever_input.get("dp"), biggest.lower_bound, biggest.peak)
        result["levers_for"] = {"file": biggest.file, by: biggest.size, "device": biggest.device,
                                "setup": vars(setup) if setup is not None else None, "facts": facts}
        result["levers_assumptions"] = [
            "each lever's saving is measured at the peak of the largest recording (the same computation as the "
            "report's advice: `tracekit report` prints the same bytes)",
            "savings do not add up: after one change the peak may move elsewhere"]
        if biggest.lower_bound:
            result["levers_assumptions"].append("the run ran out of memory: what it would need after a lever is a "
                                                "lower bound too (\"fits?\")")
    return result
