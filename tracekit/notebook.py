"""The notebook view of a recording: the report text with a picture of each device's stacked timeline (HTML)."""
from __future__ import annotations

import base64
import html

from .analysis.units import fmt_bytes
from .palette import RESERVED_COLOR, category_color


def summary_html(rec, rules=None, width=720, height=200) -> str:
    """HTML: per device, the stacked-by-category timeline (inline PNG) with its legend, then the report."""
    from .png import encode, timeline_pixels

    report = rec.report(rules)
    parts = ['<div class="tracekit-summary">']
    for d in report["devices"]:
        img, top, names = timeline_pixels(rec, d["device"], width, height, rules)
        src = "data:image/png;base64," + base64.b64encode(encode(img)).decode("ascii")
        at_peak = d.get("categories_at_peak") or {}
        legend = " ".join(
            f'<span style="white-space:nowrap"><span style="display:inline-block;width:10px;height:10px;'
            f'background:{category_color(c, names)}"></span> {html.escape(c)} {fmt_bytes(at_peak.get(c, 0))}</span>'
            for c in names if at_peak.get(c))
        if d.get("peak_reserved_bytes") is not None and d["label"] != "cpu":
            legend += (f' <span style="white-space:nowrap"><span style="display:inline-block;width:10px;height:2px;'
                       f'background:{RESERVED_COLOR};vertical-align:middle"></span> reserved</span>')
        parts.append(
            f'<div><b>{html.escape(d["label"])}</b>: peak {fmt_bytes(d["peak_allocated_bytes"])} allocated '
            f'(top of the picture: {fmt_bytes(top)})<br>'
            f'<img src="{src}" width="{width}" height="{height}" alt="memory over time by category"><br>'
            f'<small>at the peak: {legend}</small></div>')
    parts.append(f"<pre>{html.escape(rec.summary(rules))}</pre></div>")
    return "\n".join(parts)
