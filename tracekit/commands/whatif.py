"""`tracekit whatif A [B] --budget 80GiB`: the largest micro-batch (or sequence) that fits, and the levers.

One recording gives an interval (an extrapolation by category); two give the line through them. A run
that ran out of memory counts with what it needed at least, and no answer contradicts the files: see
analysis/estimate/batch_fit.py. The levers are the report's advice, priced by the same computation."""
from __future__ import annotations

from dataclasses import replace

import click

from ..errors import TracekitError
from ._common import json_option, no_cache_option, open_trace, show, size_callback
from ._estimate_options import model_options, overrides_from, setup_options, shape_from


RELATIVE = 100  # a recording whose size is unknown counts as this many units: the answer in hundredths of it


def point(path, by, size, no_cache, relative_ok=False):
    """(Point, trace, report) from one recording: every device's moments, what it needed, and its size (with
    `relative_ok`, a file that does not say its size counts as RELATIVE units: answers are multiples of it)."""
    from ..analysis.estimate.batch_fit import point_from_report
    from ..analysis.report import build_report

    trace = open_trace(path, no_cache)
    if not trace.devices:
        raise TracekitError(f"{path}: no device memory recorded")
    if size is None:
        shape = ((trace.recorder or {}).get("model") or {}).get("input_shape") or []
        k = 0 if by == "batch" else 1
        if len(shape) > k and isinstance(shape[k], int):
            size = shape[k]
        elif relative_ok:
            size = RELATIVE
        else:
            raise TracekitError(f"{path}: the file does not say its {by} size; give --sizes (one per file)")
    report = build_report(trace)
    return point_from_report(path, report, size), trace, report


def _knobs(f):
    return setup_options(f, defaults=False)


def alloc_options(f):
    """--alloc-conf and what goes with it (tracekit/commands/_alloc_conf.py)."""
    f = click.option("--memory-limit", callback=size_callback, metavar="SIZE",
                     help="With --alloc-conf: a per-process memory cap (set_per_process_memory_fraction) "
                          "in bytes; default: the file's.")(f)
    f = click.option("--device-memory", callback=size_callback, metavar="SIZE",
                     help="With --alloc-conf: what CUDA lets the process reserve; default: from the file "
                          "(at an OOM: reserved + free then; else the device's total).")(f)
    f = click.option("--start", "alloc_start", type=click.Choice(["recorded", "rebuilt"]), default="recorded",
                     show_default=True,
                     help="With --alloc-conf: start from the allocator's state when the trace began, rebuilt from "
                          "the final segments as the report does (recorded: the run under the recorded settings "
                          "reproduces the recorded peak), or from an empty allocator that first allocates what was "
                          "held then (rebuilt).")(f)
    return click.option("--alloc-conf", metavar="SETTINGS",
                        help='Replay the requests under these caching-allocator settings, in '
                             'PYTORCH_CUDA_ALLOC_CONF syntax: "expandable_segments:True,max_split_size_mb:128".')(f)


@click.command("whatif")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=True, path_type=str))
@click.option("--budget", callback=size_callback, help="Memory per GPU to fit in: 80GiB, 24GB, ...")
@click.option("--by", type=click.Choice(["batch", "seq"]), default="batch", show_default=True,
              help="What differs between the recordings (and what to grow).")
@click.option("--sizes", help="The micro-batch (or seq) of each file, e.g. 8,16 (default: what the recorder stored).")
@model_options
@_knobs
@alloc_options
@json_option
@no_cache_option
def command(files, budget, by, sizes, as_json, no_cache, alloc_conf=None, **kw):
    """From one or two recordings at different micro-batch sizes (or sequence lengths): the largest that
    fits --budget, and what each usual lever would save. With --alloc-conf: one recording's requests
    replayed under other caching-allocator settings (reserved peak, waste, whether an OOM would fit).

    \b
    tracekit whatif bs8.pickle bs16.pickle --budget 80GiB
    tracekit whatif step.pickle --budget 24GiB --config llama-3-8b --precision bf16
    tracekit whatif step.pickle --alloc-conf expandable_segments:True
    """
    if alloc_conf is not None:  # issue 24: allocator settings, its own path
        from ._alloc_conf import run

        return run(files, alloc_conf, kw.pop("alloc_start"), kw.pop("device_memory"), kw.pop("memory_limit"),
                   as_json, no_cache)
    for k in ("alloc_start", "device_memory", "memory_limit"):
        kw.pop(k, None)
    if budget is None:
        raise click.UsageError("Missing option '--budget' (or give --alloc-conf for allocator settings).")
    from ..analysis.estimate.measured import recorded_setup
    from ..analysis.estimate.shapes import ModelShape
    from ..analysis.estimate.batch_fit import fit_to_budget
    from ..analysis.levers import file_facts, not_offered

    if len(files) > 2:
        raise TracekitError("whatif takes one or two recordings")
    size_list = [None] * len(files)
    if sizes:
        try:
            size_list = [int(s) for s in sizes.split(",")]
        except ValueError:
            raise TracekitError(f"--sizes {sizes!r}: give whole numbers, one per file (e.g. 8,16)") from None
        if len(size_list) != len(files) or min(size_list) < 1:
            raise TracekitError(f"--sizes needs one positive size per file ({len(files)})")
    points, traces, reports = [], [], []
    for path, size in zip(files, size_list):
        p, trace, report = point(path, by, size, no_cache, relative_ok=len(files) == 1)
        points.append(p)
        traces.append(trace)
        reports.append(report)
    shape = shape_from(kw)
    rshape, rsetup, _ = recorded_setup(traces[-1])
    shape = shape or (rshape if isinstance(rshape, ModelShape) else None)
    overrides = overrides_from(kw)
    setup = replace(rsetup or _default_setup(), **overrides).check() if shape is not None else None
    # the levers: for the largest recording's device that needed the most, from the same computation as the report
    k = max(range(len(points)), key=lambda i: points[i].size)
    big, trace, report = points[k], traces[k], reports[k]
    dev = next(d for d in report["devices"] if d["label"] == big.device)
    facts = file_facts(trace, dev["device"], dev, shape=shape, setup=setup,
                       batch=big.size if by == "batch" and sizes else None, expandable=True)
    if overrides.get("mode") and (overrides["mode"] == "train") != (facts["workload"] == "training"):
        facts["workload_note"] = (f"--mode {overrides['mode']} was given, but the file shows a {facts['workload']} "
                                  f"run ({facts['workload_source']}): the file's evidence decides the levers")
    spikes = [f for f in report["findings"] if f["kind"] == "spike" and f["device"] == dev["device"]]
    lever_input = {"at_peak": dev.get("categories_at_peak") or {}, "fragmentation": big.fragmentation,
                   "spikes": spikes, "dp": overrides.get("dp")}
    result = fit_to_budget(points, budget, by, facts, lever_input, setup, not_offered(facts))
    if len(files) == 1 and size_list[0] is None and points[0].size == RELATIVE and not _says_size(traces[0], by):
        relative(result, by)
    show("whatif", result, as_json)


def _says_size(trace, by) -> bool:
    shape = ((trace.recorder or {}).get("model") or {}).get("input_shape") or []
    k = 0 if by == "batch" else 1
    return len(shape) > k and isinstance(shape[k], int)


def relative(result: dict, by: str) -> None:
    """A recording that does not say its size: the answers as multiples of it (the recording = 1×)."""
    to = lambda v: None if v is None else round(v / RELATIVE, 2)  # noqa: E731
    rng = result.get(f"largest_{by}_range")
    result["relative"] = {"unit": RELATIVE, "what": f"the recorded {by}",
                          "why": f"the file does not say its {by} size (give --sizes for absolute numbers)"}
    result[f"largest_{by}_multiple"] = to(result.get(f"largest_{by}"))
    result[f"largest_{by}_multiple_range"] = None if rng is None else [to(rng[0]), to(rng[1])]
    result[f"largest_{by}_multiple_estimate"] = to(result.get(f"largest_{by}_estimate"))


def _default_setup():
    from ..analysis.estimate import Setup

    return Setup()
