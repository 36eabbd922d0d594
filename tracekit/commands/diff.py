"""`tracekit diff A B`: what changed between two recordings (b − a)."""
import click

from ..analysis.diff import diff
from ._common import json_option, no_cache_option, open_trace, rules_option, show


@click.command("diff")
@click.argument("a", type=click.Path(path_type=str))
@click.argument("b", type=click.Path(path_type=str))
@json_option
@rules_option
@no_cache_option
def command(a, b, as_json, rules, no_cache):
    """Compare recording A (before) with B (after), every change B - A.

    Aligned by phase and iteration (the n-th recorded iteration of A against
    the n-th of B), per category, per allocation site (your line) and per
    module, and the findings added and removed. Changes under 1% of the
    larger peak are noise and left out of the text (kept in --json)."""
    result = diff(open_trace(a, no_cache), open_trace(b, no_cache), rules)
    if not result["devices"]:
        raise click.ClickException("the two files have no device in common")
    show("diff", result, as_json, nl=as_json)
