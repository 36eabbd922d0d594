"""Byte sizes for people: 1.5 GiB, 312.5 MiB; and back: "2GiB" -> 2147483648."""
from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def fmt_bytes(n) -> str:
    if n is None:
        return "n/a"
    n = int(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{sign}{n / scale:.1f} {unit}"
    return f"{sign}{n} B"


def parse_bytes(text: str) -> int:
    """Parse "2GiB", "512 MB", "1e9" or "1048576"; ValueError with a clear message otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (try 2GiB, 512MiB, 1.5GB or a number of bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
