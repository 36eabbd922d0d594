"""`tracekit check FILE`: a memory budget for CI. Exit 0 within budget, 1 over it (or out of memory), 2 on bad input.

    tracekit check step.pickle --max-peak 2GiB --max activation=1GiB --max optimizer_state=512MiB --no-leaks
    tracekit check step.pickle            # the defaults: no out-of-memory error, no leak

A file that records an out-of-memory error always fails (exit 1), whatever the budgets. With no
criterion, check checks the defaults (no out-of-memory error, no leak). The output lists what was
checked and what was not. A SIZE is a number with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB;
1.5GiB) or a whole number of bytes (1073741824, 1e9), above zero; anything else (0, 1.5, -1, 1e999,
inf) is refused in one line with exit 2.
"""
from __future__ import annotations

import sys

import click

from ..units import parse_bytes
from ..errors import TracekitError
from ._common import file_argument, json_option, no_cache_option, open_trace, rules_option, show


class BudgetError(TracekitError):
    """A budget that is not a size: one line, exit 2 (never exit 1, which CI reads as over budget)."""


def _size(ctx, param, value):
    if value is None:
        return None
    try:
        got = parse_bytes(value, unit_required=True)
    except ValueError as e:
        raise BudgetError(f"{param.opts[0]}: {e}") from None
    if got <= 0:
        raise BudgetError(f"{param.opts[0]}: {value!r} is not a budget: give a size above zero")
    return got


def _budgets(ctx, param, values):
    out = {}
    for v in values:
        name, sep, size = v.partition("=")
        if not sep or not name.strip():
            raise BudgetError(f"--max: {v!r} is not CATEGORY=SIZE (e.g. activation=1GiB)")
        try:
            out[name.strip()] = parse_bytes(size, unit_required=True)
        except ValueError as e:
            raise BudgetError(f"--max {name.strip()}: {e}") from None
        if out[name.strip()] <= 0:
            raise BudgetError(f"--max {name.strip()}: {size.strip()!r} is not a budget: give a size above zero")
    return out


@click.command("check")
@file_argument
@click.option("--max-peak", callback=_size, metavar="SIZE", help="Budget for the peak allocated bytes (any device).")
@click.option("--max-reserved", callback=_size, metavar="SIZE", help="Budget for the peak reserved bytes.")
@click.option("--max", "budgets", multiple=True, callback=_budgets, metavar="CATEGORY=SIZE",
              help="Budget for a category at the peak, e.g. activation=1GiB (repeatable).")
@click.option("--no-leaks", is_flag=True, help="Fail when a leak is found (checked by default when no criterion is given).")
@rules_option
@json_option
@no_cache_option
def command(file, max_peak, max_reserved, budgets, no_leaks, rules, as_json, no_cache):
    """Fail (exit 1) when a recording FILE ran out of memory or is over its memory budget.

    With no criterion: no out-of-memory error and no leak."""
    from ..analysis.budget import check
    from ..analysis.categories import CATEGORIES as CATEGORY_NAMES
    from ..analysis.report import build_report

    trace = open_trace(file, no_cache)
    report = build_report(trace, rules=rules)
    known = set(CATEGORY_NAMES) | {n for d in report["devices"] for n in d.get("category_names", [])}
    unknown = sorted(set(budgets) - known)
    if unknown:
        raise BudgetError(f"--max: unknown categor{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)} "
                          f"(known: {', '.join(sorted(known))})")
    result = check(report, max_peak, max_reserved, budgets, no_leaks)
    problems = result["problems"]
    if as_json:
        show("check", {"file": file, **result}, as_json=True)
    else:
        kinds = {p["what"] for p in problems}
        parts = (["out of memory (the run failed)"] if "oom" in kinds else []) + (
            ["over budget"] if kinds - {"oom", "leak"} else []) + (["leaking"] if "leak" in kinds else [])
        head = " and ".join(parts) or "within budget"
        click.echo(f"{file}: {head}")
        for p in problems:
            click.echo(f"  - {p['message']}")
        click.echo(f"checked: {'; '.join(result['checked'])}")
        if result["not_checked"]:
            click.echo(f"not checked: {'; '.join(result['not_checked'])}")
        for n in result["notes"]:
            click.echo(f"note: {n}")
    sys.exit(1 if problems else 0)
