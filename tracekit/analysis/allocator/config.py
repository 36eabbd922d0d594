"""The caching allocator's settings: PYTORCH_CUDA_ALLOC_CONF text, or what a snapshot recorded.

The constants and rules follow c10/cuda/CUDACachingAllocator.cpp and the allocator
config parser (CUDAAllocatorConfig, later c10/core/AllocatorConfig) of torch 2.0 to
2.13; docs/allocator.md says which facts come from where.

Values are read as torch reads them (c10/core/AllocatorConfig.h, ConfigTokenizer):
white space (C isspace) is dropped by the tokenizer; a whole number is std::stoull's
(an optional sign, then the longest run of ASCII digits 0-9, the rest of the token
ignored; none: refused; past 2**64-1: refused; a minus sign wraps modulo 2**64),
so `1_000` reads 1 and Arabic-Indic or full-width digits are refused; a fraction is
std::stod's (decimal or hexadecimal, the longest prefix; a result that overflows or
is subnormal is refused, as glibc's ERANGE makes stod throw). Analysis never imports
torch: tests/test_bounded_cost.py checks this table against the installed torch's own
parser when it is importable.
"""
from __future__ import annotations

from typing import Any
import math
import re
import sys
from dataclasses import dataclass, field, replace

from ...errors import TracekitError

MB = 1 << 20
MIN_BLOCK = 512  # every request is rounded up to a multiple of this
SMALL_SIZE = 1 << 20  # requests up to 1 MiB go to the small pool
SMALL_BUFFER = 2 << 20  # small-pool segments (and expandable small-pool pages) are 2 MiB
LARGE_BUFFER = 20 << 20  # 1-10 MiB requests get a 20 MiB segment; expandable large-pool pages are 20 MiB
MIN_LARGE_ALLOC = 10 << 20  # from here a new segment is the request rounded up to...
ROUND_LARGE = 2 << 20  # ...2 MiB
NO_LIMIT = 2**64 - 1  # max_split_size when unset (SIZE_MAX)
INTERVALS = 16  # roundup_power2_divisions: one setting per power-of-two interval from 1 MiB to 64 GiB
POWER2_START_LOG2 = 20  # ...the first interval starts at 2**20 B (1 MiB)
DEFAULT_TOTAL_MEMORY = 80 << 30  # a device's memory when the file does not say (an 80 GiB card)


def expandable_pages(total_memory: int, page: int) -> int:
    """Pages of address space a growing segment reserves: 1 1/8 of the device's memory (ExpandableSegment's
    max_handles), rounded up to whole pages."""
    return -(-(total_memory + total_memory // 8) // page)


class ConfigError(TracekitError):
    """A PYTORCH_CUDA_ALLOC_CONF string the allocator would refuse."""


@dataclass(frozen=True)
class AllocatorConfig:
    """The settings that change the native caching allocator's decisions."""

    max_split_size: int = NO_LIMIT  # blocks this large or larger are never split ("oversize")
    max_non_split_rounding: int = LARGE_BUFFER  # an oversize request may take a cached block this much bigger
    roundup_power2_divisions: tuple = field(default=(0,) * INTERVALS)  # per interval [1,2),[2,4),...MiB
    garbage_collection_threshold: float = 0.0  # acts only under a per-process memory fraction
    expandable_segments: bool = False
    # accepted, recorded, and without effect on where blocks go:
    release_lock_on_cudamalloc: bool = False
    backend: str = "native"
    text: str = ""  # the PYTORCH_CUDA_ALLOC_CONF it came from ("" when defaults or from a file)

    def divisions(self, size: int) -> int:
        """roundup_power2_divisions for a request of `size` bytes (intervals start at 1 MiB, end at 64 GiB)."""
        index = size.bit_length() - 1 - POWER2_START_LOG2
        return self.roundup_power2_divisions[min(max(index, 0), INTERVALS - 1)]

    def round_size(self, size: int) -> int:
        """The size the allocator looks for: at least 512, a multiple of 512, or a power-of-two division."""
        if size < MIN_BLOCK:
            return MIN_BLOCK
        div = self.divisions(size)
        if div > 1 and size > MIN_BLOCK * div:
            return _next_division(size, div)
        return -(-size // MIN_BLOCK) * MIN_BLOCK

    def describe(self) -> str:
        """The settings in PYTORCH_CUDA_ALLOC_CONF syntax (defaults left out; "defaults" when all are)."""
        parts = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size != NO_LIMIT:
            parts.append(f"max_split_size_mb:{self.max_split_size // MB}")
        if self.max_non_split_rounding != LARGE_BUFFER:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding // MB}")
        divs = self.roundup_power2_divisions
        if any(divs):
            if len(set(divs)) == 1:
                parts.append(f"roundup_power2_divisions:{divs[0]}")
            else:
                parts.append("roundup_power2_divisions:[" + ",".join(
                    f"{1 << i}:{d}" for i, d in enumerate(divs) if i == 0 or d != divs[i - 1]) + "]")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold:g}")
        return ",".join(parts) or "defaults"


def _next_division(size: int, divisions: int) -> int:
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    low = size & ~(step - 1)
    return size if low == size else low + step


DEFAULT = AllocatorConfig()

KNOWN_KEYS = ("max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
              "roundup_power2_divisions", "expandable_segments", "release_lock_on_cudamalloc",
              "pinned_use_cuda_host_register", "pinned_num_register_threads", "pinned_use_background_threads",
              "backend")


def parse_alloc_conf(text: str, base: AllocatorConfig = DEFAULT) -> AllocatorConfig:
    """Parse PYTORCH_CUDA_ALLOC_CONF syntax ("expandable_segments:True,max_split_size_mb:128", ...)
    on top of `base`, with the checks torch makes; ConfigError (one line) for what torch would refuse."""
    tokens = _lex(text)
    out: dict[str, Any] = {}
    i = 0

    def value(key):
        nonlocal i
        if i + 1 >= len(tokens) or tokens[i + 1] != ":" or i + 2 >= len(tokens) or tokens[i + 2] in ",:[]":
            raise ConfigError(f"--alloc-conf: {key} needs a value ({key}:VALUE)")
        i += 2
        return tokens[i]

    while i < len(tokens):
        key = tokens[i]
        if key in (",", ":", "[", "]"):
            raise ConfigError(f"--alloc-conf {_show(text)}: expected a setting name, found {key!r}")
        if key == "max_split_size_mb" or key == "max_non_split_rounding_mb":
            mb = _int(key, value(key))
            if mb < LARGE_BUFFER // MB:
                raise ConfigError(f"--alloc-conf: {key} must be at least {LARGE_BUFFER // MB} (got {mb})")
            field_name = "max_split_size" if key == "max_split_size_mb" else "max_non_split_rounding"
            out[field_name] = min(mb, NO_LIMIT // MB) * MB
        elif key == "garbage_collection_threshold":
            raw = value(key)
            v = _stod(key, raw)
            if not (0.0 < v < 1.0):
                raise ConfigError(f"--alloc-conf: garbage_collection_threshold must be in (0, 1) (got {_show(raw)})")
            out["garbage_collection_threshold"] = v
        elif key == "roundup_power2_divisions":
            divs, i = _divisions(tokens, i)
            out["roundup_power2_divisions"] = divs
        elif key in ("expandable_segments", "release_lock_on_cudamalloc", "release_lock_on_hipmalloc",
                     "pinned_use_cuda_host_register", "pinned_use_hip_host_register", "pinned_use_background_threads"):
            v = value(key)
            if v not in ("True", "False"):
                raise ConfigError(f"--alloc-conf: {key} takes True or False (got {_show(v)})")
            if key == "expandable_segments":
                out["expandable_segments"] = v == "True"
            elif key.startswith("release_lock"):
                out["release_lock_on_cudamalloc"] = v == "True"
        elif key == "pinned_num_register_threads":
            n = _int(key, value(key))
            if n < 1 or n & (n - 1) or n > 128:
                raise ConfigError(f"--alloc-conf: pinned_num_register_threads must be a power of 2 up to 128 (got {n})")
        elif key == "backend":
            v = value(key)
            if v not in ("native", "cudaMallocAsync"):
                raise ConfigError(f"--alloc-conf: backend is native or cudaMallocAsync (got {_show(v)})")
            if v == "cudaMallocAsync":
                raise ConfigError("--alloc-conf: backend:cudaMallocAsync hands memory to CUDA's own pool, "
                                  "whose decisions tracekit does not model")
            out["backend"] = v
        else:
            raise ConfigError(f"--alloc-conf: unknown setting {_show(key)} (known: {', '.join(KNOWN_KEYS)})")
        i += 1
        if i < len(tokens):
            if tokens[i] != ",":
                raise ConfigError(f"--alloc-conf {_show(text)}: expected ',' after {key}, found {_show(tokens[i])}")
            i += 1
    return replace(base, text=text, **out)


def _lex(text: str) -> list[str]:
    buf: list
    tokens, buf = [], []
    for ch in str(text):
        if ch in ",:[]":
            if buf:
                tokens.append("".join(buf))
                buf = []
            tokens.append(ch)
        elif ch not in _C_SPACE:
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


_C_SPACE = " \t\n\v\f\r"  # what C's isspace drops in torch's tokenizer
_STOULL = re.compile(r"[+-]?([0-9]+)")  # ASCII digits only: [0-9], not \d
_HEX = re.compile(r"[+-]?0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][+-]?[0-9]+)?")
_DEC = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_INF_NAN = re.compile(r"[+-]?(?:inf(?:inity)?|nan(?:\([0-9A-Za-z_]*\))?)", re.IGNORECASE)
SIZE_MAX = 2**64 - 1


def _show(text, n=80) -> str:
    """A token or setting for a message: quoted, at most `n` characters of it."""
    text = str(text)
    return repr(text) if len(text) <= n else repr(text[:n]) + f"... ({len(text):,} characters)"


def _int(key, raw) -> int:
    """std::stoull(raw) as torch's tokenizer calls it (see the module's note); ConfigError where it throws."""
    m = _STOULL.match(raw)
    if not m:
        raise ConfigError(f"--alloc-conf: {key} must be a whole number in ASCII digits 0-9 (got {_show(raw)})")
    digits = m.group(1).lstrip("0")
    if len(digits) > 20 or int(digits or "0") > SIZE_MAX:
        raise ConfigError(f"--alloc-conf: {key} is out of range (more than 2**64-1; got {_show(raw)})")
    v = int(digits or "0")
    return (-v) % 2**64 if raw.startswith("-") else v


def _stod(key, raw) -> float:
    """std::stod(raw) (strtod's longest prefix, then ERANGE); ConfigError where it throws."""
    m = _HEX.match(raw)
    if m:
        try:
            v = float.fromhex(m.group())
        except OverflowError:  # 0x1p99999: strtod gives HUGE_VAL and ERANGE
            v = math.inf
    else:
        m = _INF_NAN.match(raw)
        if m:
            return float("nan") if "nan" in m.group().lower() else float("inf")  # refused by the range check
        m = _DEC.match(raw)
        if not m:
            raise ConfigError(f"--alloc-conf: {key} must be a number in (0, 1) (got {_show(raw)})")
        v = float(m.group())
    if math.isinf(v) or (v != 0 and abs(v) < sys.float_info.min and not _exact(m.group(), v)):
        raise ConfigError(f"--alloc-conf: {key} is out of the range of a normal double (got {_show(raw)})")
    return v


def _exact(text: str, v: float) -> bool:
    """Whether the number `text` is exactly `v` (glibc's strtod sets ERANGE for a subnormal result only when
    it is rounded); a text too long to check is taken as rounded."""
    from fractions import Fraction

    body = text.lstrip("+-")
    if len(body) > 1000:
        return False
    if body[:2].lower() == "0x":
        mant, _, exp = body[2:].lower().partition("p")
        whole, _, frac = mant.partition(".")
        if abs(int(exp or "0")) > 5000:
            return False
        exact = Fraction(int(whole + frac or "0", 16), 16 ** len(frac)) * Fraction(2) ** int(exp or "0")
    else:
        mant, _, exp = body.lower().partition("e")
        if abs(int(exp or "0")) > 5000:
            return False
        exact = Fraction(mant) * Fraction(10) ** int(exp or "0")
    return Fraction(abs(v)) == exact


def _pow2_or_zero(key, v, zero_ok=True):
    if v == 0 and zero_ok:
        return v
    if v < 1 or v & (v - 1):
        raise ConfigError(f"--alloc-conf: {key} values must be powers of 2{' or 0' if zero_ok else ''} (got {v})")
    return v


def _divisions(tokens, i):
    """roundup_power2_divisions:N or roundup_power2_divisions:[256:1,512:2,>:4] (MiB interval starts)."""
    key = "roundup_power2_divisions"
    if i + 2 >= len(tokens) or tokens[i + 1] != ":":
        raise ConfigError(f"--alloc-conf: {key} needs a value ({key}:4 or {key}:[256:1,>:4])")
    i += 2
    if tokens[i] != "[":
        v = _pow2_or_zero(key, _int(key, tokens[i]), zero_ok=False)
        return (v,) * INTERVALS, i
    divs = [0] * INTERVALS
    first, last = True, 0
    i += 1
    while i < len(tokens) and tokens[i] != "]":
        start = tokens[i]
        if i + 2 >= len(tokens) or tokens[i + 1] != ":":
            raise ConfigError(f"--alloc-conf: {key} entries are INTERVAL_MB:DIVISIONS (e.g. [256:1,>:4])")
        v = _pow2_or_zero(key, _int(key, tokens[i + 2]))
        i += 3
        if start == ">":  # the intervals after the last one named (torch >= 2.9; older torch also overwrote that one)
            for k in range(last + 1 if not first else 0, INTERVALS):
                divs[k] = v
        else:
            mb = _int(key, start)
            if mb < 1 or mb & (mb - 1):
                raise ConfigError(f"--alloc-conf: {key} interval starts must be powers of 2 in MiB (got {_show(start)})")
            index = min(mb.bit_length() - 1, INTERVALS - 1)
            if first:
                for k in range(index):
                    divs[k] = v
                first = False
            divs[index] = v
            last = index
        if i < len(tokens) and tokens[i] == ",":
            i += 1
    if i >= len(tokens):
        raise ConfigError(f"--alloc-conf: {key} list is missing its closing ']'")
    return tuple(divs), i


def from_settings(settings) -> tuple[AllocatorConfig, list[str]]:
    """The config a snapshot's `allocator_settings` records (torch >= 2.4); defaults for what it lacks.

    Returns (config, notes): a note for each setting that could not be read."""
    notes = []
    if not isinstance(settings, dict):
        return DEFAULT, ["the file does not record the allocator's settings: assumed torch's defaults"]
    kw: dict[str, Any] = {}
    mss = settings.get("max_split_size")
    if isinstance(mss, int) and 0 < mss < NO_LIMIT:
        kw["max_split_size"] = mss
    rounding = settings.get("max_non_split_rounding_size")
    if isinstance(rounding, int) and rounding > 0:
        kw["max_non_split_rounding"] = rounding
    gc = settings.get("garbage_collection_threshold")
    if isinstance(gc, (int, float)) and 0 < gc < 1:
        kw["garbage_collection_threshold"] = float(gc)
    if settings.get("expandable_segments") is True:
        kw["expandable_segments"] = True
    divs = settings.get("roundup_power2_divisions")
    if isinstance(divs, dict):
        out = [0] * INTERVALS
        for k, v in divs.items():
            try:
                mb, v = int(k), int(v)
            except (TypeError, ValueError):
                notes.append(f"roundup_power2_divisions entry {k!r}: {v!r} not understood")
                continue
            if mb >= 1 and mb & (mb - 1) == 0 and v >= 0:
                out[min(mb.bit_length() - 1, INTERVALS - 1)] = v
        kw["roundup_power2_divisions"] = tuple(out)
    elif isinstance(divs, (list, tuple)) and len(divs) == INTERVALS:
        kw["roundup_power2_divisions"] = tuple(int(v) for v in divs)
    elif isinstance(divs, int) and divs > 0:
        kw["roundup_power2_divisions"] = (divs,) * INTERVALS
    text = settings.get("PYTORCH_CUDA_ALLOC_CONF") or settings.get("last_allocator_settings") or ""
    if isinstance(text, str) and "cudaMallocAsync" in text:
        notes.append("recorded with backend:cudaMallocAsync: CUDA's own pool placed the blocks, not this model")
    return replace(DEFAULT, **kw), notes
