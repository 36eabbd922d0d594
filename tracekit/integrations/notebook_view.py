"""The notebook view of a recording: the report text with a picture of each device's stacked timeline
(HTML, written by tracekit.render's report/html reporter from the report and the timeline PNGs)."""
from __future__ import annotations

from ..render import reporter


def summary_html(rec, rules=None, width=720, height=200) -> str:
    """HTML: per device, the stacked-by-category timeline (inline PNG) with its legend, then the report."""
    report = rec.report(rules)
    from ..render.png import TimelinePng

    png = reporter("timeline", "png")
    assert isinstance(png, TimelinePng)
    timelines = {d["device"]: png.picture(rec, d["device"], width, height, rules) for d in report["devices"]}
    return reporter("report", "html").render(report, text=rec.summary(rules), timelines=timelines,
                                             width=width, height=height)
