"""`tracekit report FILE`: peak, categories and findings per device; `tracekit report DIR` or several
files: one row per rank and the imbalance between ranks."""
import click

from ._common import (json_option, no_cache_option, open_trace, rules_option, show, window_line, window_of,
                      window_options)
from ._estimate_options import report_options, report_spec


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
    from ..io.cache.reports import file_report

    spec = report_spec(estimate_knobs)
    report, trace = file_report(files[0], _open_writing_behind, _analyse, not no_cache, window, rules, spec,
                                want_trace=not as_json)
    if trace is None and isinstance(report.get("names_cut"), int):  # served from the cache: open_trace did not say
        from ..io.limits import names_cut_line

        click.echo(names_cut_line(report["names_cut"]), err=True)
    if as_json:
        show("report", report, as_json=True)
    else:
        if trace.meta.get("window"):
            click.echo(window_line(trace))
        show("report", {k: v for k, v in report.items() if k not in ("window", "names_cut")}, trace=trace)


def _open_writing_behind(path, no_cache, window):
    """open_trace, the cache's entry written beside the analysis (file_report waits for it)."""
    return open_trace(path, no_cache, window, write_behind=True)


def _analyse(trace, **options):
    """The report of a trace (imported here, so that a report served from the cache never loads the analysis)."""
    from ..analysis.report import build_report

    return build_report(trace, **options, lean=True)  # the trace is thrown away after: no analysis is kept


def _ranks(files, as_json, rules, no_cache, jobs, no_summaries):
    from ..errors import TracekitError
    from ..analysis.rank_pool import open_ranks

    table = open_ranks(files, jobs=jobs, use_summaries=not no_summaries, use_cache=not no_cache, rules=rules)
    show("ranks", table, as_json, nl=as_json)
    if table["errors"]:
        raise TracekitError(f"{len(table['errors'])} of {table['files']} files could not be read: "
                            + "; ".join(e["error"] for e in table["errors"][:3]))
