"""`tracekit report FILE`: peak, categories and findings per device."""
import click

from ..analysis.report import build_report
from ..render import report_text
from ._common import echo_json, file_argument, json_option, no_cache_option, open_trace, rules_option
from .estimate import report_options, report_spec


@click.command("report")
@file_argument
@json_option
@rules_option
@no_cache_option
@report_options
def command(file, as_json, rules, no_cache, **estimate_knobs):
    """Peak, categories and findings of a memory FILE (snapshot or profiler trace)."""
    spec = report_spec(estimate_knobs)
    trace = open_trace(file, no_cache)
    report = build_report(trace, rules=rules, estimate=spec)
    if as_json:
        echo_json(report)
    else:
        click.echo(report_text(report, t0_by_device=_first_times(trace)))


def _first_times(trace):
    from ..model import NO_TIME

    out = {}
    for d in trace.devices:
        t = trace.events.time_us[trace.device_events(d)]
        t = t[t != NO_TIME]
        out[d] = int(t.min()) if len(t) else None
    return out
