"""`tracekit report FILE`: peak, categories and findings per device."""
import click

from ..analysis.report import build_report
from ..render import trace_report_text
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
        click.echo(trace_report_text(trace, report))
