"""Plain-text rendering of a many-rank report: one row per rank, then the imbalance."""
from __future__ import annotations

from ..units import fmt_bytes, fmt_bytes_exact
from . import Reporter
from .diff import relative

MIN_COLUMN_SHARE = 0.01  # a category gets a column when it holds this much of some rank's peak


def ranks_text(table: dict) -> str:
    rows = table["ranks"]
    out = [f"{len(rows)} ranks (ranks from {table['rank_source']}; {table['from_summaries']} read from the summaries "
           f"beside the files, {table['analysed']} analysed{_workers(table)})", ""]
    cats = _columns(rows)
    head = ["rank", "peak", "when"] + cats + ["findings", "file"]
    body = [[str(r["rank"]), ("≥ " if r.get("demand_is_lower_bound") else "") + fmt_bytes(r["peak_allocated_bytes"]),
             _when(r)]
            + [fmt_bytes(r["categories_at_peak"].get(c, 0)) for c in cats]
            + [", ".join(f"{k} {n}" for k, n in r["findings"].items()) or "-", _short(r["file"])] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    right = {1} | {3 + i for i in range(len(cats))}
    for line in [head] + body:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))]
        out.append("  " + "  ".join(cells).rstrip())
    died = [r for r in rows if r.get("demand_is_lower_bound")]
    if died:
        out.append(f"  ≥: rank{'s' if len(died) > 1 else ''} {', '.join(str(r['rank']) for r in died)} ran out of memory: "
                   "the figure is what it needed at least (live when a request failed + the request), not its peak")
    out.append("")
    out += holds_lines(rows)
    out += imbalance_lines(table.get("imbalance"))
    for e in table.get("errors") or []:
        out.append(f"not read: {e['error']}")
    return "\n".join(out).rstrip() + "\n"


MAX_HOLDS_LINES = 8  # more ranks than this: the first rank's line, and whether the others hold the same share


def holds_lines(rows) -> list[str]:
    """What each rank of a sharded / data-parallel job holds ("rank 0 holds 1/2 of the parameters ...")."""
    held = [r["holds"] for r in rows if isinstance(r.get("holds"), dict) and r["holds"].get("summary")]
    if not held:
        return []
    if len(held) <= MAX_HOLDS_LINES:
        return [f"  {h['summary']}" for h in held] + [""]
    same = len({(h.get("share"), h.get("local_parameter_bytes")) for h in held}) == 1
    return [f"  {held[0]['summary']}",
            f"  ({'every other rank holds the same share' if same else 'the ranks hold different shares: see --json'};"
            f" {len(held)} ranks)", ""]


def _two(a: int, b: int) -> tuple[str, str]:
    """Two sizes with enough digits that different bytes never read the same."""
    for digits in (1, 2, 3):
        x, y = fmt_bytes_exact(a, digits), fmt_bytes_exact(b, digits)
        if x != y or a == b:
            return x, y
    return f"{a:,} B", f"{b:,} B"


def imbalance_lines(imb: dict | None) -> list[str]:
    if not imb:
        return []
    if imb.get("equal") or imb["min_bytes"] == imb["max_bytes"]:
        n = imb.get("ranks")
        return [f"Balanced: {('both ranks' if n == 2 else f'all {n} ranks') if n else 'every rank'} peak at "
                f"{fmt_bytes(imb['max_bytes'])} (to the byte)."]
    ratio = f"max/min {imb['max_over_min']:.2f}" if imb.get("max_over_min") else "max/min n/a"
    lo, hi = _two(imb["min_bytes"], imb["max_bytes"])
    out = [f"Imbalance: peaks from {lo} (rank {imb['min_rank']}) to "
           f"{hi} (rank {imb['max_rank']}), {ratio}; median {fmt_bytes(imb['median_bytes'])}"]
    o = imb.get("outlier")
    if o is None:
        out.append(f"Balanced: no rank peaks {imb['threshold_share']:.0%} or more away from the others' median.")
        return out
    sign = "+" if o["over_others_bytes"] > 0 else ""
    rel = relative({"a": o["others_bytes"], "b": o["peak_bytes"], "change": o["over_others_bytes"]})
    why = ", ".join(f"{c['category']} {'+' if c['bytes'] > 0 else ''}{fmt_bytes(c['bytes'])}"
                    f" ({fmt_bytes(c['others_bytes'] + c['bytes'])} vs {fmt_bytes(c['others_bytes'])})"
                    for c in o["by_category"][:3])
    out.append(f"Outlier: rank {o['rank']} peaks at {fmt_bytes(o['peak_bytes'])}, "
               f"{sign}{fmt_bytes(o['over_others_bytes'])}"
               f" ({rel}) against the other ranks' median of {fmt_bytes(o['others_bytes'])}"
               + (f"; by category: {why}" if why else "") + ".")
    return out


def _columns(rows) -> list[str]:
    order = ("parameter", "unsharded_parameter", "gradient", "optimizer_state", "activation", "temporary", "input",
             "kv_cache", "communication", "other")
    seen = {}
    for r in rows:
        peak = r.get("peak_allocated_bytes") or 0
        for c, b in r["categories_at_peak"].items():
            if peak and b >= MIN_COLUMN_SHARE * peak:
                seen[c] = True
    return [c for c in order if c in seen] + sorted(c for c in seen if c not in order)


def _when(r) -> str:
    w = r.get("peak_when") or ""
    return w.removeprefix("in the ").replace(" pass of iteration ", ", iteration ").replace(" step of iteration ",
                                                                                             ", iteration ") or "-"


def _short(path: str, n: int = 40) -> str:
    return path if len(path) <= n else "..." + path[-(n - 3):]


def _workers(table) -> str:
    w = table.get("workers") or 0
    return f" by {w} processes" if w > 1 else ""


class RanksText(Reporter):
    """`tracekit report DIR` as text: one row per rank, the imbalance and the outlier."""

    kind, format = "ranks", "text"

    def render(self, table) -> str:
        return ranks_text(table)
