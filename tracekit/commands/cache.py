"""`tracekit cache`: where the columnar cache of opened files lives, how big it is; --clear empties it."""
import os

import click

from ..analysis.units import fmt_bytes
from ..io import cache


@click.command("cache")
@click.option("--clear", is_flag=True, help="Delete every cached file.")
def command(clear):
    """Show (or --clear) the cache that makes a second open of a file fast."""
    folder = cache.cache_dir()
    if clear:
        click.echo(f"removed {cache.clear()} cached files from {folder}")
        return
    files = [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".npz")] if os.path.isdir(folder) else []
    total = sum(os.path.getsize(f) for f in files)
    click.echo(f"{folder}: {len(files)} cached files, {fmt_bytes(total)} (set TRACEKIT_CACHE_DIR to move it)")
