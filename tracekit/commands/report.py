"""`tracekit report FILE`: peak, categories and findings per device; `tracekit report DIR` or several
files: one row per rank and the imbalance between ranks."""
import click

from ..analysis.report import build_report
from ..render import trace_report_text
from ._common import (echo_json, json_option, no_cache_option, open_trace, rules_option, window_line, window_of,
                      window_options)
from .estimate import report_options, report_spec


@click.command("report")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=True, path_type=str))
@json_option
@rules_option
@no_cache_option
@click.option("--jobs", type=click.IntRange(min=1), default=None,
              help="With several files or a folder: processes that analyse them (default: the cores).")
@click.option("--no-summaries", is_flag=True,
              help="With several files or a folder: analyse every file, ignoring the summaries beside them.")
@report_options
@window_options
def command(files, as_json, rules, no_cache, jobs, no_summaries, **estimate_knobs):
    """Peak, categories and findings of a memory FILE (snapshot or profiler trace).

    Given a folder or several files (the ranks of one job), one row per rank
    instead: peak, when, categories and findings, and the imbalance between
    ranks. Ranks come from the recorder's metadata, else `.rankN.` in the
    names, else the order given; the summary the recorder writes beside each
    rank's file is read instead of the file when it is there."""
    import os

    window = window_of(estimate_knobs)
    if len(files) > 1 or os.path.isdir(files[0]):
        if window:
            raise click.UsageError("--from/--to/--last/--iterations apply to one FILE, not to several ranks")
        if any(v not in (None, False, ()) for v in estimate_knobs.values()):
            raise click.UsageError("--estimate-config and its knobs apply to one FILE, not to several ranks")
        return _ranks(files, as_json, rules, no_cache, jobs, no_summaries)
    spec = report_spec(estimate_knobs)
    trace = open_trace(files[0], no_cache, window)
    report = build_report(trace, rules=rules, estimate=spec)
    cut = trace.meta.get("window")
    if as_json:
        echo_json({**report, "window": cut} if cut else report)
    else:
        if cut:
            click.echo(window_line(trace))
        click.echo(trace_report_text(trace, report))


def _ranks(files, as_json, rules, no_cache, jobs, no_summaries):
    from ..errors import TracekitError
    from ..ranks import open_ranks
    from ..render import ranks_text

    table = open_ranks(files, jobs=jobs, use_summaries=not no_summaries, use_cache=not no_cache, rules=rules)
    if as_json:
        echo_json(table)
    else:
        click.echo(ranks_text(table), nl=False)
    if table["errors"]:
        raise TracekitError(f"{len(table['errors'])} of {table['files']} files could not be read: "
                            + "; ".join(e["error"] for e in table["errors"][:3]))
