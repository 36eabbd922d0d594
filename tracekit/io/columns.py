"""Builders that intern strings, frames and stacks while a loader fills columns."""
from __future__ import annotations

from operator import itemgetter

import numpy as np

from ..model import Frames, Stacks, Strings

_frame_key = itemgetter("filename", "line", "name")


class Interner:
    """Interns strings, frames (filename, line, name) and stacks (tuples of frames)."""

    def __init__(self):
        self.strings = Strings()
        self._frame_ids = {}
        self._f_file, self._f_line, self._f_name = [], [], []
        self._stack_ids = {(): 0}
        self._stack_offsets = [0, 0]
        self._stack_frames = []

    def stack_id(self, frames) -> int:
        """Stack id of a list of frame dicts ({filename, line, name}); -1 when empty."""
        if not frames:
            return -1
        try:
            key = tuple(map(_frame_key, frames))
        except (KeyError, TypeError):
            key = tuple(_loose_frame(f) for f in frames)
        sid = self._stack_ids.get(key)
        if sid is None:
            sid = self._new_stack(key)
        return sid

    def stack_ids(self, frame_lists) -> list:
        """stack_id of each list of frames: the same as [stack_id(f) for f in ...], faster."""
        ids, new, key_of = self._stack_ids, self._new_stack, _frame_key
        out = []
        append = out.append
        try:
            for frames in frame_lists:
                if not frames:
                    append(-1)
                    continue
                key = tuple(map(key_of, frames))
                sid = ids.get(key)
                append(new(key) if sid is None else sid)
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
                self._f_file.append(self.strings.intern(str(filename)))
                self._f_line.append(_clamp_int32(line))
                self._f_name.append(self.strings.intern(str(name)))
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


def _loose_frame(f):
    """A frame from a dict missing keys or of the wrong type (tolerated, never fatal)."""
    if not isinstance(f, dict):
        return ("?", 0, str(f)[:200])
    return (str(f.get("filename", "?")), f.get("line", 0), str(f.get("name", "?")))


def _clamp_int32(v) -> int:
    try:
        v = int(v)
    except (TypeError, ValueError):
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
                raise ValueError(f"{what} {i} is {v!r}, not a valid integer") from None
        raise
