"""`tracekit info FILE`: format facts (devices, entries, time span, fields, truncation, frames)."""
import click

from ..analysis.info import file_info
from ._common import file_argument, json_option, no_cache_option, open_trace, show, window_of, window_options


@click.command("info")
@file_argument
@json_option
@no_cache_option
@window_options
def command(file, as_json, no_cache, **window):
    """Format facts about a memory FILE: what it holds and how complete it is."""
    info = file_info(open_trace(file, no_cache, window_of(window)))
    show("info", info, as_json, nl=as_json)
