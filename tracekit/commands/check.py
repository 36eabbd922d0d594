"""`tracekit check FILE`: a memory budget for CI. Exit 0 within budget, 1 over it, 2 on bad input.

    tracekit check step.pickle --max-peak 2GiB --max activation=1GiB --max optimizer_state=512MiB --no-leaks

A SIZE is a number with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; 1.5GiB) or a whole number of
bytes (1073741824, 1e9); anything else (1.5, -1, 1e999, inf) is refused in one line with exit 2.
"""
from __future__ import annotations

import sys

import click

from ..analysis.units import fmt_bytes, parse_bytes
from ..errors import TracekitError
from ._common import file_argument, json_option, no_cache_option, open_trace, rules_option


class BudgetError(TracekitError):
    """A budget that is not a size: one line, exit 2 (never exit 1, which CI reads as over budget)."""


def _size(ctx, param, value):
    if value is None:
        return None
    try:
        return parse_bytes(value)
    except ValueError as e:
        raise BudgetError(f"{param.opts[0]}: {e}") from None


def _budgets(ctx, param, values):
    out = {}
    for v in values:
        name, sep, size = v.partition("=")
        if not sep or not name.strip():
            raise BudgetError(f"--max: {v!r} is not CATEGORY=SIZE (e.g. activation=1GiB)")
        try:
            out[name.strip()] = parse_bytes(size)
        except ValueError as e:
            raise BudgetError(f"--max {name.strip()}: {e}") from None
    return out


@click.command("check")
@file_argument
@click.option("--max-peak", callback=_size, metavar="SIZE", help="Budget for the peak allocated bytes (any device).")
@click.option("--max-reserved", callback=_size, metavar="SIZE", help="Budget for the peak reserved bytes.")
@click.option("--max", "budgets", multiple=True, callback=_budgets, metavar="CATEGORY=SIZE",
              help="Budget for a category at the peak, e.g. activation=1GiB (repeatable).")
@click.option("--no-leaks", is_flag=True, help="Fail when a leak is found.")
@rules_option
@json_option
@no_cache_option
def command(file, max_peak, max_reserved, budgets, no_leaks, rules, as_json, no_cache):
    """Fail (exit 1) when a recording FILE is over its memory budget."""
    from ..analysis.report import build_report

    trace = open_trace(file, no_cache)
    report = build_report(trace, rules=rules)
    known = set(CATEGORY_NAMES) | {n for d in report["devices"] for n in d.get("category_names", [])}
    unknown = sorted(set(budgets) - known)
    if unknown:
        raise BudgetError(f"--max: unknown categor{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)} "
                          f"(known: {', '.join(sorted(known))})")
    problems = over_budget(report, max_peak, max_reserved, budgets, no_leaks)
    if as_json:
        import json

        click.echo(json.dumps({"file": file, "ok": not problems, "problems": problems}, indent=2))
    elif problems:
        click.echo(f"{file}: over budget", err=False)
        for p in problems:
            click.echo(f"  - {p['message']}")
    else:
        click.echo(f"{file}: within budget")
    sys.exit(1 if problems else 0)


from ..analysis.categories import CATEGORIES as CATEGORY_NAMES  # noqa: E402


def over_budget(report, max_peak, max_reserved, budgets, no_leaks) -> list[dict]:
    """What is over budget, as [{"what", "device", "bytes", "limit", "message"}]."""
    out = []

    def add(what, d, got, limit, text):
        out.append({"what": what, "device": d["device"], "bytes": got, "limit": limit,
                    "message": f"{d['label']}: {text} {fmt_bytes(got)} > {fmt_bytes(limit)} "
                               f"(over by {fmt_bytes(got - limit)})"})

    for d in report["devices"]:
        if max_peak is not None and (d["peak_allocated_bytes"] or 0) > max_peak:
            add("peak", d, d["peak_allocated_bytes"], max_peak, "peak allocated")
            top = (d.get("top_stacks_at_peak") or [{}])[0]
            if top.get("where"):
                out[-1]["message"] += f"; largest site at the peak: {fmt_bytes(top['bytes'])} from {top['where']}"
        if max_reserved is not None and (d["peak_reserved_bytes"] or 0) > max_reserved:
            add("reserved", d, d["peak_reserved_bytes"], max_reserved, "peak reserved")
        at_peak = d.get("categories_at_peak", {})
        for name, limit in budgets.items():
            got = at_peak.get(name, 0)
            if got > limit:
                add(name, d, got, limit, f"{name} at the peak")
    if no_leaks:
        labels = {d["device"]: d["label"] for d in report["devices"]}
        for f in report["findings"]:
            if f["kind"] == "leak":
                out.append({"what": "leak", "device": f["device"], "bytes": f["bytes"], "limit": 0,
                            "message": f"{labels.get(f['device'], f['device'])}: leak: {f['summary']}"})
    return out
