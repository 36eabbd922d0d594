"""Python stacks captured cheaply while recording, turned into frames once, when the file is written.

A stack is captured as the code objects and instruction offsets (``f_lasti``) of its frames, innermost
first, and interned: `StackTable.key(parts, parent)` gives the id of the stack made of `parts` (code,
offset, code, offset, ...) below the already-interned stack `parent` (0: none). Interning by prefix
keeps the table small (the frames of a training loop repeat every iteration) and lets the recorder
reuse the part of a stack that cannot have changed: while a module's forward runs, every frame above it
is suspended at the same instruction (oplog.py).

The executing line of a frame is found from its offset (`code.co_lines()`), so it is the line that
runs (``(q @ k.transpose(-2, -1)).softmax(-1)``, a line of a lambda, of a comprehension, of code at
module level), not the line where the function begins. A line the table does not know (an artificial
instruction) is that of the instruction before it, else the function's first line: never 0.

No frame object is kept, only code objects (which hold no locals, tensors or modules). The recorder's
own frames (tracekit/record/, except the demo model toy.py) are left out of the frames written.
"""
from __future__ import annotations

import bisect
import os
import re

_OVERRIDES = os.path.join("torch", "overrides.py")
_HIDDEN: set = set()  # code objects of the recorder's bootstrap (script.py's `-c` line): not the program's


def hide(code):
    """Leave frames of `code` out of every stack written (the `tracekit record` bootstrap)."""
    _HIDDEN.add(code)

_OP = object()  # parts (_OP, name, parent): an operator name as a frame (stacks="all")
_OURS = re.compile(r"[/\\]tracekit[/\\]record[/\\](?!toy\.py$)[^/\\]+\.py$")


class StackTable:
    """Interned stacks: id -> (parts, parent id); frames (dicts, innermost first) on demand."""

    def __init__(self):
        self._ids = {}  # (code, lasti, ..., parent) -> id
        self._parts = [()]  # id -> (code, lasti, ..., parent): id 0 is the empty stack
        self._frames = {}  # id -> [frame dict], memoised
        self._lines = {}  # code -> (starts, lines) of its line table
        self._ours = {}  # code -> bool: one of the recorder's own frames

    def __len__(self):
        return len(self._parts)

    def key(self, parts: tuple) -> int:
        """The id of a stack: `parts` = (code, lasti, code, lasti, ..., parent id)."""
        k = self._ids.get(parts)
        if k is None:
            k = self._ids[parts] = len(self._parts)
            self._parts.append(parts)
        return k

    def key_op(self, name: str, parent: int) -> int:
        """The id of stack `parent` with the operator `name` as its innermost frame (empty file, line 0)."""
        return self.key((_OP, name, parent))

    def frames(self, k: int) -> list:
        """[{"filename", "line", "name"}] of stack `k`, innermost first, without the recorder's frames."""
        out = self._frames.get(k)
        if out is None:
            k0, out = k, []
            chain = []
            while k:  # ids of the prefixes, innermost segment first
                chain.append(k)
                k = self._parts[k][-1]
            for kk in chain:
                parts = self._parts[kk]
                if parts[0] is _OP:
                    out.append({"filename": "", "line": 0, "name": parts[1]})
                    continue
                for i in range(0, len(parts) - 1, 2):
                    code, lasti = parts[i], parts[i + 1]
                    if self._is_ours(code):
                        continue
                    out.append({"filename": code.co_filename, "line": self.line(code, lasti),
                                "name": code.co_name})
            self._frames[k0] = out
        return out


    def line(self, code, lasti: int) -> int:
        table = self._lines.get(code)
        if table is None:
            table = self._lines[code] = _line_table(code)
        starts, lines = table
        if lasti is None or lasti < 0 or not starts:
            return code.co_firstlineno or 1
        i = bisect.bisect_right(starts, lasti) - 1
        return lines[i] if i >= 0 else (code.co_firstlineno or 1)

    def _is_ours(self, code) -> bool:
        """The recorder's own frames, and torch's dispatch to our mode (handle_torch_function): not the program's."""
        v = self._ours.get(code)
        if v is None:
            name = code.co_filename or ""
            v = self._ours[code] = bool(_OURS.search(name)) or code in _HIDDEN or (
                code.co_name == "handle_torch_function" and name.endswith(_OVERRIDES))
        return v

    def clear(self):
        """Drop everything (the code objects included), once the file is written."""
        self._ids = {}
        self._parts = [()]
        self._frames = {}
        self._lines = {}
        self._ours = {}


def _line_table(code):
    """(starts, lines): the instruction offsets where a line begins and that line; an offset without a
    line (None in co_lines) takes the line before it, or the function's first line."""
    starts, lines = [], []
    last = code.co_firstlineno or 1
    try:
        ranges = list(code.co_lines())
    except AttributeError:  # Python < 3.10: the line of the whole function
        return [0], [last]
    for start, _end, line in ranges:
        if line is None or line <= 0:
            line = last
        last = line
        if lines and lines[-1] == line:
            continue
        starts.append(start)
        lines.append(line)
    return starts, lines

