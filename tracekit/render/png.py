"""A picture of memory over time, stacked by category, as PNG bytes: numpy and zlib, no display, no plotting library.

Used where no Qt window exists (notebooks, reports): the viewer draws its own.
"""
from __future__ import annotations

import struct
import zlib

import numpy as np

from ..model import Trace
from . import Reporter
from .palette import RESERVED_COLOR, category_color

BACKGROUND, AXIS = (255, 255, 255), (120, 120, 120)


def encode(rgb: np.ndarray) -> bytes:
    """PNG bytes of an (height, width, 3) uint8 image (8-bit RGB, no filter)."""
    h, w, _ = rgb.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), np.ascontiguousarray(rgb, np.uint8).reshape(h, w * 3)], axis=1)

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw.tobytes(), 6)) + chunk(b"IEND", b""))


def rgb(hex_color: str) -> tuple:
    h = hex_color.lstrip("#")
    return tuple(int(h[i:i + 2], 16) for i in (0, 2, 4))


def timeline_pixels(trace: Trace, device: int, width=720, height=200, rules=None):
    """(image, top_bytes, names): the stacked category timeline of one device as an RGB array.

    Each pixel column shows the entry with the most allocated bytes among
    those it covers (so no peak is lost), stacked in category order from the
    bottom; reserved memory is a dark line above. x is time when the file has
    times, else entry order. `top_bytes` is the value of the top edge.
    """
    from ..analysis.timeline import category_series

    s = category_series(trace, device, max_points=4 * width, rules=rules)
    names = s.names
    img = np.full((height, width, 3), BACKGROUND, np.uint8)
    n = len(s.index)
    top = max(int(s.total.max()) if n else 0, int(s.reserved.max()) if s.reserved is not None and n else 0, 1)
    top = int(top * 1.05)
    if n:
        x = s.time_us.astype(np.float64) if s.time_us is not None else s.index.astype(np.float64)
        lo, hi = float(x.min()), float(x.max())
        col = np.zeros(n, np.int64) if hi <= lo else ((x - lo) / (hi - lo) * (width - 1)).round().astype(np.int64)
        # the point with the largest total in each column; empty columns hold the previous point
        order = np.lexsort((s.total, col))
        last_in_col = np.flatnonzero(np.diff(np.append(col[order], width)) != 0)
        best = np.full(width, -1, np.int64)
        best[col[order][last_in_col]] = order[last_in_col]
        best = np.maximum.accumulate(np.where(best >= 0, np.arange(width), -1))
        pick = np.full(width, -1, np.int64)
        pick[col[order][last_in_col]] = order[last_in_col]
        pick = pick[np.maximum(best, 0)]
        stack = np.cumsum(np.stack([s.by_category[c][pick] for c in names]), axis=0)  # (k, width)
        px = np.clip((stack / top * (height - 1)).round().astype(np.int64), 0, height - 1)
        rows = (height - 1 - np.arange(height))[:, None]  # pixel row -> height from the bottom
        below = np.zeros(width, np.int64)
        for k, name in enumerate(names):
            fill = (rows >= below[None, :]) & (rows < px[k][None, :])
            img[fill] = rgb(category_color(name, names))
            below = px[k]
        if s.reserved is not None:
            r = np.clip((s.reserved[pick] / top * (height - 1)).round().astype(np.int64), 0, height - 1)
            img[height - 1 - r, np.arange(width)] = rgb(RESERVED_COLOR)
    img[:, 0] = AXIS
    img[height - 1, :] = AXIS
    return img, top, names


class TimelinePng(Reporter):
    """A device's memory over time, stacked by category, as PNG bytes: `render(trace, device=0, width, height,
    rules)`; `picture(...)` also gives the top of the picture in bytes and the categories drawn."""

    kind, format = "timeline", "png"

    def render(self, trace, device=0, width=720, height=200, rules=None) -> bytes:
        return self.picture(trace, device, width, height, rules)[0]

    def picture(self, trace, device=0, width=720, height=200, rules=None):
        img, top, names = timeline_pixels(trace, device, width, height, rules)
        return encode(img), top, names
