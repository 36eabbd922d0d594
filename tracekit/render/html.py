"""HTML of a report: per device, a picture of memory over time (a PNG from png.py) with its legend,
then the text report. What the notebook view shows (integrations/notebook_view.py)."""
from __future__ import annotations

import base64
import html

from ..units import fmt_bytes
from . import Reporter
from .palette import RESERVED_COLOR, category_color


class ReportHtml(Reporter):
    """`render(report, text=..., timelines={device: (png_bytes, top_bytes, category_names)}, width, height)`:
    one block per device (its timeline picture when given, the legend of what is live at the peak), then
    the text report (`text`, as ReportText writes it)."""

    kind, format = "report", "html"

    def render(self, report, text="", timelines=None, width=720, height=200) -> str:
        timelines = timelines or {}
        parts = ['<div class="tracekit-summary">']
        for d in report["devices"]:
            png, top, names = timelines.get(d["device"], (None, None, ()))
            at_peak = d.get("categories_at_peak") or {}
            legend = " ".join(
                f'<span style="white-space:nowrap"><span style="display:inline-block;width:10px;height:10px;'
                f'background:{category_color(c, names)}"></span> {html.escape(c)} {fmt_bytes(at_peak.get(c, 0))}</span>'
                for c in (names or at_peak) if at_peak.get(c))
            if d.get("peak_reserved_bytes") is not None and d["label"] != "cpu":
                legend += (f' <span style="white-space:nowrap"><span style="display:inline-block;width:10px;height:2px;'
                           f'background:{RESERVED_COLOR};vertical-align:middle"></span> reserved</span>')
            picture = ""
            if png is not None:
                src = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
                picture = (f'(top of the picture: {fmt_bytes(top)})<br>'
                           f'<img src="{src}" width="{width}" height="{height}" alt="memory over time by category">')
            parts.append(
                f'<div><b>{html.escape(d["label"])}</b>: peak {fmt_bytes(d["peak_allocated_bytes"])} allocated '
                f'{picture}<br>'
                f'<small>at the peak: {legend}</small></div>')
        parts.append(f"<pre>{html.escape(text)}</pre></div>")
        return "\n".join(parts)
