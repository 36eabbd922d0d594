"""`tracekit query FILE "SELECT ..."`: SQL over the file's allocations, events and timeline."""
import click

from ..analysis.sql import TABLES, query
from ._common import file_argument, no_cache_option, open_trace, rules_option


@click.command("query")
@file_argument
@click.argument("sql")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True,
              help="How to print the result (json: one object per row, sizes in bytes).")
@click.option("--engine", type=click.Choice(["duckdb", "sqlite"]), default=None,
              help="Default: DuckDB when installed (pip install duckdb), else SQLite.")
@rules_option
@no_cache_option
def command(file, sql, fmt, engine, rules, no_cache):
    """Run SQL over a memory FILE's tables: allocations, events, timeline.

    \b
    tracekit query step.pickle "SELECT category, sum(size) FROM allocations GROUP BY 1"
    tracekit query step.pickle "SELECT user_frame, count(*), sum(size) FROM allocations
        WHERE phase = 'backward' GROUP BY 1 ORDER BY 3 DESC LIMIT 10"

    Columns: tracekit query FILE "SELECT * FROM allocations LIMIT 0" (and events, timeline).
    """
    if engine == "duckdb":
        try:
            import duckdb  # noqa: F401
        except ImportError:
            raise click.UsageError("--engine duckdb needs DuckDB: pip install duckdb (or 'tracekit[sql]')") from None
    result = query(open_trace(file, no_cache), sql, rules=rules, engine=engine)
    if fmt == "csv":
        click.echo(result.to_csv(index=False), nl=False)
    elif fmt == "json":
        click.echo(result.to_json(orient="records", indent=1))
    elif result.empty:
        click.echo(f"(no rows; columns: {', '.join(map(str, result.columns))})")
    else:
        click.echo(result.to_string(index=False, max_colwidth=80))


__all__ = ["command", "TABLES"]
