"""Options and helpers shared by the commands that open files."""
from __future__ import annotations

import json

import click

from ..io import load
from ..io.progress import StderrProgress

file_argument = click.argument("file", type=click.Path(dir_okay=True, path_type=str))
no_cache_option = click.option("--no-cache", is_flag=True, help="Do not read or write the columnar cache.")
rules_option = click.option("--rules", type=click.Path(exists=True, dir_okay=False),
                            help="User category rules (TOML), applied on top of tags and inference.")
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")


def open_trace(path, no_cache=False):
    """Load a file, drawing progress on stderr if it takes more than a second."""
    progress = StderrProgress(f"opening {path}")
    try:
        return load(path, progress=progress, use_cache=not no_cache)
    finally:
        progress.close()


def echo_json(obj):
    click.echo(json.dumps(obj, indent=2))
