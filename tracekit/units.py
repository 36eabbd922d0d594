"""Byte sizes for people: 1.5 GiB, 312.5 MiB; and back: "2GiB" -> 2147483648."""
from __future__ import annotations

import decimal
import re

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def fmt_bytes(n) -> str:
    return fmt_bytes_exact(n, 1)


def fmt_bytes_exact(n, digits: int = 1) -> str:
    """`fmt_bytes` with `digits` decimals (bytes stay whole)."""
    if n is None:
        return "n/a"
    n = int(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{sign}{n / scale:.{digits}f} {unit}"
    return f"{sign}{n} B"


def fmt_pair(a, b) -> tuple[str, str]:
    """Two sizes with just enough digits that different numbers never read the same
    ("1.008 GiB" and "1.000 GiB", not "1.0 GiB" twice); equal numbers read equal. Falls back to
    exact byte counts when even 6 decimals cannot tell them apart."""
    if a is None or b is None or int(a) == int(b):
        return fmt_bytes(a), fmt_bytes(b)
    for digits in range(1, 7):
        x, y = fmt_bytes_exact(a, digits), fmt_bytes_exact(b, digits)
        if x != y:
            return x, y
    return f"{int(a):,} B", f"{int(b):,} B"


MAX_BYTES = 2**63 - 1  # what an int64 byte count holds (8 EiB)


UNITS_HINT = "B, KiB, MiB, GiB, TiB (or kB, MB, GB, TB)"


def parse_bytes(text: str, unit_required: bool = False) -> int:
    """Parse "2GiB", "512 MB", "1.5GB", "1e9" or "1048576" to bytes; ValueError with a clear message otherwise.

    A number without a unit is bytes and must be whole ("1.5" is refused: give a unit, 1.5GiB); with a
    unit it is rounded to the nearest byte. Negative, non-finite and over-8-EiB values are refused.
    `unit_required` (every byte option of the command line): a bare number is refused, naming the units,
    since "--budget 80" means 80 GB to a person and 80 bytes to the parser ("80B" says bytes)."""
    shown = repr(str(text) if len(str(text)) <= 40 else str(text)[:40] + "...")
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]{1,6}))?\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(3).lower() not in _UNITS:
        raise ValueError(f"{shown} is not a size (try 2GiB, 512MiB, 1.5GB or a whole number of bytes)")
    number, exponent, unit = m.group(1), int(m.group(2) or 0), m.group(3).lower()
    if exponent > 30:
        raise ValueError(f"{shown} is larger than any memory (at most 8 EiB)")
    with decimal.localcontext() as ctx:
        ctx.prec = 80
        value = decimal.Decimal(number).scaleb(exponent) * _UNITS[unit]
        if unit in ("", "b") and value != value.to_integral_value():
            raise ValueError(f"{shown} is not a whole number of bytes: add a unit (e.g. {number}GiB) "
                             "or give an integer")
        whole = int(value.to_integral_value(decimal.ROUND_HALF_EVEN))
    if whole > MAX_BYTES:
        raise ValueError(f"{shown} is larger than any memory (at most 8 EiB)")
    if unit_required and not unit:
        raise ValueError(f"{shown} has no unit: give one of {UNITS_HINT} (e.g. {str(text).strip()}GiB, "
                         f"or {str(text).strip()}B for bytes)")
    return whole
