"""Reporters (tracekit/render): one result in, one format out, found by (kind, format)."""
import json

import pytest

import tracekit
from tracekit.analysis.report import build_report
from tracekit.render import REPORTERS, Reporter, formats, reporter
from tracekit.render.text import report_text, trace_report_text

from .conftest import SAMPLES


def test_every_listed_reporter_is_found_and_says_what_it_writes():
    for (kind, fmt) in REPORTERS:
        r = reporter(kind, fmt)
        assert isinstance(r, Reporter) and (r.kind, r.format) == (kind, fmt)
    assert formats("report") == ["html", "json", "text"]
    with pytest.raises(ValueError, match="no png reporter for report"):
        reporter("report", "png")


def test_text_json_and_html_of_one_report_say_the_same():
    trace = tracekit.load(SAMPLES / "leak_loop.pickle", use_cache=False)
    report = build_report(trace)
    assert json.loads(reporter("report", "json").render(report)) == json.loads(json.dumps(report))
    text = reporter("report", "text").render(report, trace=trace)
    assert text == trace_report_text(trace, report) and text != report_text(report)  # times from the trace's origin
    png, top, names = reporter("timeline", "png").picture(trace, 0, 200, 80)
    assert png.startswith(b"\x89PNG") and top >= report["devices"][0]["peak_allocated_bytes"]
    html = reporter("report", "html").render(report, text=text, timelines={0: (png, top, names)})
    assert "data:image/png;base64," in html and "leak" in html
