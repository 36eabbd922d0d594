"""`tracekit cache`: where the columnar cache of opened files lives, how big it is; --clear empties it."""
import click

from ..io.cache import folder as cache_folder
from ..io.cache import traces
from ..units import fmt_bytes


@click.command("cache")
@click.option("--clear", is_flag=True, help="Delete every cached file.")
def command(clear):
    """Show (or --clear) the cache that makes a second open of a file fast."""
    folder = cache_folder.cache_dir()
    if clear:
        click.echo(f"removed {traces.clear()} cached files from {folder}")
        return
    files = traces.entries()
    total = sum(size for _, size in files)
    click.echo(f"{folder}: {len(files)} cached files, {fmt_bytes(total)} (set TRACEKIT_CACHE_DIR to move it)")
