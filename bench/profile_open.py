#!/usr/bin/env python3
"""One first open of a file, stage by stage: wall time and peak memory (VmHWM) of each stage.

Run by `bench/bench_open.py --profile` in a fresh process. Each stage is called on its own, in the
order `report --json --no-cache` needs it (each analysis is memoised on the trace, so what a stage
computes is not computed again by a later one); the kernel's peak-RSS mark is reset before each stage
(/proc/self/clear_refs), so "peak" is the most memory the process held during that stage and "held"
what it holds after it. Prints one JSON object per stage on stdout.

Usage: python bench/profile_open.py FILE
"""
from __future__ import annotations

import json
import sys
import time


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def _reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def main():
    path = sys.argv[1]
    state = {}

    def read():
        from tracekit.io import load

        state["trace"] = load(path, use_cache=False)

    def each_device(fn):
        def run():
            from tracekit.analysis.replay import replay

            reps = replay(state["trace"])
            for d in state["trace"].devices:
                fn(state["trace"], reps[d])
        return run

    def replay():
        from tracekit.analysis.replay import replay as r

        r(state["trace"])

    def allocator():  # as build_report starts: the model, which keeps the replay's reserved curve when equal
        from tracekit.analysis.allocator.summary import allocator_replays
        from tracekit.analysis.replay import replay as r
        from tracekit.analysis.report import _share_reserved

        allocator_replays(state["trace"])
        _share_reserved(state["trace"], r(state["trace"]))

    def phases():
        from tracekit.analysis.phases import phases as p

        p(state["trace"])

    def categories():
        from tracekit.analysis.categories import categorize

        categorize(state["trace"], None)

    def sites(trace, rep):
        from tracekit.analysis.sites import allocation_sites

        allocation_sites(trace, rep)

    def libraries(trace, rep):
        from tracekit.analysis.libraries import allocation_libraries

        allocation_libraries(trace, rep.device)

    def modules(trace, rep):
        from tracekit.analysis.modules import allocation_module_ids

        allocation_module_ids(trace, rep)

    def report():
        from tracekit.analysis.report import build_report

        state["report"] = build_report(state["trace"], lean=True)  # as `report` builds it

    def write():
        from tracekit.render import reporter

        state["json"] = reporter("report", "json").render(state["report"])

    stages = [("read/scan", read), ("replay", replay), ("allocator model", allocator), ("phases", phases),
              ("categories", categories), ("sites", each_device(sites)), ("libraries", each_device(libraries)),
              ("module tree", each_device(modules)), ("findings (rest)", report), ("JSON write", write)]
    start = time.perf_counter()
    for name, fn in stages:
        _reset_peak()
        t = time.perf_counter()
        fn()
        print(json.dumps({"stage": name, "seconds": time.perf_counter() - t, "peak_mib": _status("VmHWM"),
                          "held_mib": _status("VmRSS")}), flush=True)
    print(json.dumps({"stage": "total", "seconds": time.perf_counter() - start, "peak_mib": None,
                      "held_mib": _status("VmRSS")}), flush=True)


if __name__ == "__main__":
    main()
