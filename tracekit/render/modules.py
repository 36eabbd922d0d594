"""The report's per-module section (analysis/modules.py)."""
from __future__ import annotations

from ..units import fmt_bytes


def module_lines(table: dict | None) -> list[str]:
    """The report's text section."""
    if not table:
        return []
    found = (" found from the stacks (no module tags in the file: the chain of forward calls, named from the "
             "library's source)" if table.get("source") == "stacks" else "")
    out = [f"  by module ({table['modules']} module/pass rows{found}; backward: made by the backward of that "
           "module's forward ops):", f"    {'at the peak':>11}  {'most held':>10}  module"]
    for r in table["rows"][:10]:
        out.append(f"    {fmt_bytes(r['bytes_at_peak']):>11}  {fmt_bytes(r['peak_bytes']):>10}  "
                   f"{r['module']} ({r['pass']})")
    for g in table["layers"][:5]:
        lo, hi = fmt_bytes(g["bytes_at_peak_min"]), fmt_bytes(g["bytes_at_peak_max"])
        each = lo if lo == hi else f"{lo}–{hi}"
        out.append(f"    {g['pattern']} ({g['pass']}): {g['layers']} modules hold {each} each at the peak "
                   f"({fmt_bytes(g['bytes_at_peak_total'])} in all), at most {fmt_bytes(g['peak_bytes_max'])}"
                   + (f"  [{g['classes']}]" if g.get("classes") else ""))
    return out
