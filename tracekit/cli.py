"""The `tracekit` command: a click group whose subcommands live in tracekit/commands/.

Subcommands are imported only when used, so `tracekit report` never pays for
torch or Qt, and each command is a small module of its own.
"""
from __future__ import annotations

import functools
import importlib
import os
import sys

import click

from .errors import TracekitError

# Commands that open files: any failure while they read or analyse one is one line and exit 2.
READS_FILES = {"info", "report", "diff", "check", "whatif", "estimate", "export", "query"}

# name -> (module in tracekit.commands, one-line help shown in `tracekit --help`)
COMMANDS = {
    "info": "Format facts about a memory file.",
    "report": "Peak, categories and findings of a memory file; of a folder or several: one row per rank.",
    "diff": "Compare two recordings: what changed beyond noise, by phase, category, site, module, finding.",
    "check": "Fail (exit 1) when a recording is over its memory budget.",
    "record": "Record a training script's memory: tracekit record -- python train.py",
    "simulate": "Run a script as if it had the GPU (no GPU needed): tracekit simulate --gpu H100 -- python train.py",
    "demo": "Record a small model step here and open the result.",
    "export": "Convert a file for pytorch.org/memory_viz, or its allocations to CSV / parquet.",
    "query": "SQL over a file's allocations, events and timeline: tracekit query FILE \"SELECT ...\"",
    "view": "Open files in the desktop viewer.",
    "cache": "Show or clear the cache that makes a second open fast.",
    "estimate": "Predict memory by category from a model config and a training setup.",
    "whatif": "Largest micro-batch that fits a budget, and what each lever saves.",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return [n for n in COMMANDS if importlib.util.find_spec(f"tracekit.commands.{n}")]

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        try:
            module = importlib.import_module(f"tracekit.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"tracekit.commands.{name}":
                return None
            raise
        command = module.command
        if name in READS_FILES and not getattr(command.callback, "guarded", False):
            command.callback = guard(command.callback)
        return command

    def format_commands(self, ctx, formatter):
        rows = [(n, COMMANDS[n]) for n in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tracekit")
def cli():
    """Record, classify and explain PyTorch memory use."""


def guard(callback):
    """The one guard for commands that read files: an unexpected exception while reading or
    analysing a file becomes a TracekitError naming the file (one line, exit 2), not a traceback.
    TRACEKIT_DEBUG=1 lets it through with its traceback, for a bug report."""
    @functools.wraps(callback)
    def run(*args, **kwargs):
        try:
            return callback(*args, **kwargs)
        except (TracekitError, click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort,
                BrokenPipeError):
            raise
        except Exception as e:
            if os.environ.get("TRACEKIT_DEBUG"):
                raise
            named = [kwargs[k] for k in ("file", "files", "a", "b", "config", "compare_path") if kwargs.get(k)]
            files = " and ".join(str(f) for n in named for f in (n if isinstance(n, (list, tuple)) else [n]))
            files = files or "the file"
            if isinstance(e, MemoryError):
                raise TracekitError(f"cannot analyse {files}: out of memory") from None
            what = "it is nested too deeply" if isinstance(e, RecursionError) else f"{type(e).__name__}: {e}"
            what = " ".join(what.split())
            what = what if len(what) <= 300 else what[:300] + "..."
            raise TracekitError(f"cannot analyse {files}: {what} (this is a bug in "
                                "tracekit; please report it with the file, TRACEKIT_DEBUG=1 shows where)") from None

    run.guarded = True
    return run


MAX_MESSAGE = 300  # characters of a usage error's message (it quotes the value given)


def main(argv=None):
    """Entry point: user errors become one line on stderr and exit code 2."""
    for stream in (sys.stdout, sys.stderr):  # file names that are not UTF-8 print as their own bytes
        try:
            stream.reconfigure(errors="surrogateescape")
        except (AttributeError, ValueError, OSError):
            pass
    try:
        return cli.main(args=argv, prog_name="tracekit", standalone_mode=False)
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:
        if isinstance(e.message, str) and len(e.message) > MAX_MESSAGE:  # a value of 120 KB is not echoed whole
            m = e.message  # its start (what was given) and its end (what is wrong with it)
            e.message = f"{m[:MAX_MESSAGE // 2]}...[{len(m) - MAX_MESSAGE:,} characters cut]...{m[-MAX_MESSAGE // 2:]}"
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except TracekitError as e:
        click.echo(f"tracekit: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("tracekit: interrupted", err=True)
        sys.exit(130)
    except MemoryError:
        click.echo("tracekit: out of memory while reading the file", err=True)
        sys.exit(2)
    except BrokenPipeError:
        # the reader went away (`tracekit report FILE | head`): what it wanted was written; stop quietly, as
        # `cat` does, and keep the interpreter from complaining again when it flushes stdout at exit
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        sys.exit(141)


if __name__ == "__main__":
    sys.exit(main())
