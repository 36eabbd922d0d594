"""Reporters: one analysis result in, one format out.

Every way tracekit shows a result goes through a `Reporter`: a small class that takes one kind of
result (the plain data an analysis returns) and writes it in one format. The CLI commands, the
notebook view and the pytest plugin ask `reporter(kind, format)` for one; the viewer draws its own
widgets but reuses the text pieces (finding lines, diff changes, rank imbalance).

    kind        the result it takes                                   formats
    report      analysis.report.build_report(trace)                   text, json, html
    info        analysis.info.file_info(trace)                        text, json
    diff        analysis.diff.diff(trace_a, trace_b)                  text, json
    ranks       analysis.rank_pool.open_ranks(paths)                  text, json
    estimate    analysis.estimate.estimate(shape, setup)              text, json
    simulate    commands._simulate: estimate --simulate's answer      text, json
    whatif      analysis.estimate.batch_fit.fit_to_budget(points, budget, ...)  text, json
    alloc_whatif analysis.allocator.settings_replay.compare(trace, config)      text, json
    timeline    a Trace and a device (memory over time by category)   png

A reporter's module is imported only when it is asked for, so `report --json` never loads the text
renderers. Adding a format is adding a class to the module of its kind and a row to REPORTERS.
"""
from __future__ import annotations

import importlib
import json
from typing import Any


class Reporter:
    """Writes one kind of result in one format. `render(result, **context)` returns str (bytes for
    binary formats); `context` carries what the result alone does not say (e.g. the time origin)."""

    kind = ""
    format = ""

    def render(self, *result: Any, **context: Any) -> Any:  # pragma: no cover - the interface
        """Each reporter names what it takes: the result first, then its context."""
        raise NotImplementedError


class JsonReporter(Reporter):
    """Any result as one JSON object (sizes in bytes), as `--json` prints it."""

    format = "json"

    def __init__(self, kind=""):
        self.kind = kind

    def render(self, result, **context) -> str:
        return json.dumps(result, indent=2)


# (kind, format) -> "module:Class" under tracekit.render
REPORTERS = {
    ("report", "text"): "text:ReportText",
    ("report", "html"): "html:ReportHtml",
    ("info", "text"): "text:InfoText",
    ("diff", "text"): "diff:DiffText",
    ("ranks", "text"): "ranks:RanksText",
    ("estimate", "text"): "estimate:EstimateText",
    ("simulate", "text"): "simulate:SimulateText",
    ("whatif", "text"): "estimate:WhatifText",
    ("alloc_whatif", "text"): "allocator:AllocWhatifText",
    ("timeline", "png"): "png:TimelinePng",
}
JSON_KINDS = ("report", "info", "diff", "ranks", "whatif", "alloc_whatif", "estimate", "simulate", "check")


def reporter(kind: str, format: str = "text") -> Reporter:
    """The reporter that writes `kind` results as `format` (ValueError when there is none)."""
    if format == "json" and kind in JSON_KINDS:
        return JsonReporter(kind)
    where = REPORTERS.get((kind, format))
    if where is None:
        raise ValueError(f"no {format} reporter for {kind} results (have: {', '.join(formats(kind)) or 'none'})")
    module, cls = where.split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)()


def formats(kind: str) -> list[str]:
    """The formats `kind` results can be written in."""
    return sorted({f for k, f in REPORTERS if k == kind} | ({"json"} if kind in JSON_KINDS else set()))
