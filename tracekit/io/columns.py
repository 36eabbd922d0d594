"""Builders that intern strings, frames and stacks while a loader fills columns."""
from __future__ import annotations

import contextvars
import re
from operator import itemgetter

import numpy as np

from ..model import Frames, Stacks, Strings
from .limits import shown, text

_frame_key = itemgetter("filename", "line", "name")

# Bounds that keep every sum of sizes and every time difference inside int64, far beyond any real device:
MAX_SIZE = 2**50  # one allocation, segment or block: 1 PiB
MAX_TOTAL = 2**62  # all allocations of a device together
MAX_TIME = 2**62  # |time_us|
MAX_DEVICE = 128  # torch numbers devices with an int8 (c10::DeviceIndex)


# Set while a file whose frames carry torch.compile's FX metadata is converted (io/reading.has_fx_frames).
FX_FRAMES = contextvars.ContextVar("tracekit_fx_frames", default=False)
_FX_LINE = re.compile(r'^\s*File "(.*)", line (\d+), in (.+?)\s*$', re.M)


def fx_key(frames) -> tuple:
    """The stack key of a frame list in which frames of torch.compile's generated code carry their graph
    node's source (`fx_original_trace`, a formatted traceback, outermost first): each such frame is replaced by
    the source frames it stands for, innermost first as in a snapshot, so phases, modules and lines see the
    model's own code (`modeling_gpt2.py:... in forward`, each module's forward) instead of the generated
    code. An outer frame the trace repeats (the compiled function's own frame, whose line is that of the
    call into the graph) is dropped there, so the chain of forward calls is not counted twice."""
    out = []
    drop = set()
    for f in frames:
        trace = f.get("fx_original_trace") if isinstance(f, dict) else None
        if not trace or not isinstance(trace, str):
            k = _frame_key(f) if isinstance(f, dict) and len(f) >= 3 else _loose_frame(f)
            if (k[0], k[2]) in drop:
                drop.discard((k[0], k[2]))
                continue
            out.append(k)
            continue
        src = [(m.group(1), _clamp_int32(m.group(2)), m.group(3)) for m in _FX_LINE.finditer(trace)]
        if not src:
            out.append(_loose_frame(f))
            continue
        out.extend(reversed(src))
        drop.add((src[0][0], src[0][2]))
    return tuple(out)


class Interner:
    """Interns strings, frames (filename, line, name) and stacks (tuples of frames).

    A frame list met again (the same object: a pickle shares it by reference)
    reuses its stack id without walking it again, so the work is linear in the
    file's size however often one long list is referenced. This relies on the
    decoded document staying alive while the Interner is used, as it does
    during a load."""

    def __init__(self):
        self.strings = Strings()
        self._by_id = {}  # id(frame list) -> stack id
        self._frame_ids = {}
        self._f_file, self._f_line, self._f_name = [], [], []
        self._stack_ids = {(): 0}
        self._stack_offsets = [0, 0]
        self._stack_frames = []

    def stack_id(self, frames) -> int:
        """Stack id of a list of frame dicts ({filename, line, name}); -1 when empty."""
        if not frames:
            return -1
        sid = self._by_id.get(id(frames))
        if sid is not None:
            return sid
        if not isinstance(frames, (list, tuple)):
            raise FramesError(f"'frames' is a {type(frames).__name__} ({text(frames)}), not a list of frames")
        try:
            key = fx_key(frames) if FX_FRAMES.get() else tuple(map(_frame_key, frames))
            sid = self._stack_ids.get(key)
        except (KeyError, TypeError):
            key = tuple(_loose_frame(f) for f in frames)
            sid = self._stack_ids.get(key)
        if sid is None:
            sid = self._new_stack(key)
        self._by_id[id(frames)] = sid
        return sid

    def stack_ids(self, frame_lists) -> list:
        """stack_id of each list of frames: the same as [stack_id(f) for f in ...], faster."""
        if FX_FRAMES.get():
            return [self.stack_id(f) for f in frame_lists]
        ids, new, key_of, by_id = self._stack_ids, self._new_stack, _frame_key, self._by_id
        out: list = []
        append = out.append
        try:
            for frames in frame_lists:
                if not frames:
                    append(-1)
                    continue
                sid = by_id.get(id(frames))
                if sid is None:
                    if type(frames) is not list:
                        raise TypeError
                    key = tuple(map(key_of, frames))
                    sid = ids.get(key)
                    if sid is None:
                        sid = new(key)
                    by_id[id(frames)] = sid
                append(sid)
        except (KeyError, TypeError):  # a malformed frame somewhere: take the tolerant path for the rest
            out.extend(self.stack_id(f) for f in frame_lists[len(out):])
        return out

    def _new_stack(self, key) -> int:
        ids = self._frame_ids
        for fk in key:
            fid = ids.get(fk)
            if fid is None:
                filename, line, name = fk
                fid = ids[fk] = len(self._f_line)
                self._f_file.append(self.strings.intern(text(filename)))
                self._f_line.append(_clamp_int32(line))
                self._f_name.append(self.strings.intern(text(name)))
            self._stack_frames.append(fid)
        sid = self._stack_ids[key] = len(self._stack_offsets) - 1
        self._stack_offsets.append(len(self._stack_frames))
        return sid

    def frames(self) -> Frames:
        return Frames(
            filename=np.array(self._f_file, dtype=np.int32),
            line=np.array(self._f_line, dtype=np.int32),
            name=np.array(self._f_name, dtype=np.int32),
        )

    def stacks(self) -> Stacks:
        return Stacks(
            offsets=np.array(self._stack_offsets, dtype=np.int64),
            frame_ids=np.array(self._stack_frames, dtype=np.int32),
        )


class FramesError(ValueError):
    """A 'frames' value that is not a list of frames."""


def _loose_frame(f):
    """A frame from a dict missing keys or of the wrong type (tolerated, never fatal): always hashable."""
    if not isinstance(f, dict):
        return ("?", 0, text(f)[:200])
    return (text(f.get("filename", "?")), _clamp_int32(f.get("line", 0)), text(f.get("name", "?")))


def _clamp_int32(v) -> int:
    if isinstance(v, str) and len(v) > 20:
        return 0
    try:
        v = int(v)
    except (TypeError, ValueError, OverflowError):
        return 0
    return max(-(2**31), min(v, 2**31 - 1))


def int_column(values, dtype, what):
    """numpy column from a list of ints; ValueError naming `what` on bad values."""
    try:
        return np.array(values, dtype=dtype)
    except (OverflowError, TypeError, ValueError):
        for i, v in enumerate(values):
            try:
                np.array([v], dtype=dtype)
            except (OverflowError, TypeError, ValueError):
                raise ValueError(f"{what} {i} is {shown(v)}, not a valid integer") from None
        raise


def check_sizes(size, what):
    """Sizes in [0, 1 PiB], summing to less than 2**62 (so no running total can overflow)."""
    bad = (size < 0) | (size > MAX_SIZE)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{what} {i} has size={int(size[i])}, not a size between 0 and 1 PiB")
    if float(size.sum(dtype=np.float64)) >= MAX_TOTAL:
        raise ValueError(f"the sizes of {what.rsplit(' ', 1)[0]} entries add up to more than 2**62 bytes")
