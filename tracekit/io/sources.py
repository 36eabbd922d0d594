"""Reading a library's Python source to name what a stack frame ran: never importing or running it.

A frame says `modeling_qwen2.py:249 in forward`; the source says that line is
inside `class Qwen2MLP`'s `forward`, and that the line of its caller
(`modeling_qwen2.py:297`) calls `self.mlp(...)`. The file is found where the
frame says it is, else in this machine's installed copy of the same package
(the same path under its folder on `sys.path`). It is read as text (at most
MAX_SOURCE_BYTES: a larger file is not read) and parsed with `ast`; nothing is
imported or executed. Each real file is parsed once however many spellings of
its path the frames use (`a/../b.py`, `./b.py`, a link): the parse is kept by
the file's identity (device, inode, size, time). One analysis parses at most
MAX_PARSED_BYTES of files it has not parsed before (`budget()`; a model's own
files take well under 1 MiB): a file past that is not read, as if absent.
Anything that cannot be read or parsed gives None.
"""
from __future__ import annotations

import ast
import functools
from contextlib import contextmanager
import os
import sys
from dataclasses import dataclass, field

MAX_SOURCE_BYTES = 1 << 20  # the largest model code is far below (transformers: ~300 KB); 1 MiB of statements: ~3.5 s


@dataclass
class Outline:
    """What tracekit needs of one source file: its functions and, per line, the module a call there runs."""

    path: str
    functions: list = field(default_factory=list)  # (first line, last line, name, enclosing class or None)
    calls: dict = field(default_factory=dict)  # line -> [(attribute chain, looped)]: `self.mlp(` -> [("mlp", False)]
    attributes: dict = field(default_factory=dict)  # class -> {attribute: class it is built from in __init__}

    def forwards(self) -> list:
        """[(first line, last line, class)] of the `forward` methods, in file order."""
        return [(lo, hi, cls) for lo, hi, name, cls in self.functions if name == "forward" and cls]

    def forward_of(self, cls: str):
        """(first line, last line) of `cls.forward`, or None."""
        for lo, hi, name, c in self.functions:
            if name == "forward" and c == cls:
                return lo, hi
        return None


def locate(filename: str, package: str | None, relative: str | None) -> tuple[str | None, str]:
    """(a readable local copy of `filename`, how it was found): the path itself, or the same file under this
    machine's installed `package` (`relative`: the path inside the package, '/'-separated)."""
    if filename and os.path.isfile(filename):
        return filename, "the recorded path"
    if not package or not relative:
        return None, ""
    path, how = _installed(package, relative, tuple(sys.path))
    return (path, how) if path and os.path.isfile(path) else (None, "")


@functools.lru_cache(maxsize=4096)
def _installed(package: str, relative: str, search: tuple) -> tuple[str | None, str]:
    parts = [p for p in relative.split("/") if p and p not in (".", "..")]
    for entry in search:
        if not entry or not os.path.isdir(entry):
            continue
        candidate = os.path.join(entry, package, *parts)
        if os.path.isfile(candidate):
            return candidate, f"this machine's installed {package} ({os.path.join(entry, package)})"
    return None, ""


def outline(path: str) -> Outline | None:
    """The functions and module calls of a Python source file, by `ast` (None: unreadable or not Python)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return _outline(path, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))


_OUTLINES: dict = {}  # (device, inode, size, mtime) -> Outline | None
_KEEP = 512
MAX_PARSED_BYTES = 4 << 20  # new source bytes one analysis may parse (about 4 s of real code, 16 s of the worst)
_left: list[int | None] = [None]  # bytes the analysis under way may still parse (None: no budget)


@contextmanager
def budget(nbytes: int | None = None):
    """Within this block, parse at most `nbytes` (default MAX_PARSED_BYTES) of files not parsed before (then
    outline gives None)."""
    old, _left[0] = _left[0], MAX_PARSED_BYTES if nbytes is None else nbytes
    try:
        yield
    finally:
        _left[0] = old


def _outline(path: str, identity: tuple) -> Outline | None:
    if identity in _OUTLINES:
        return _OUTLINES[identity]
    if _left[0] is not None:
        if identity[2] > _left[0]:
            return None  # over this analysis's budget: not kept, so that another analysis may parse it
        _left[0] -= identity[2]
    got = _parse(path, identity[2])
    if len(_OUTLINES) >= _KEEP:
        _OUTLINES.pop(next(iter(_OUTLINES)))
    _OUTLINES[identity] = got
    return got


def _parse(path: str, size: int) -> Outline | None:
    try:
        if size > MAX_SOURCE_BYTES:
            return None
        with open(path, "rb") as f:
            text = f.read(MAX_SOURCE_BYTES + 1).decode("utf-8", errors="replace")
        if len(text) > MAX_SOURCE_BYTES:
            return None
        tree = ast.parse(text, filename=path)
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    out = Outline(path=path)
    loops: dict = {}  # loop variable -> attribute chain it iterates over (`for layer in self.layers[:n]`)

    def chain(node):
        """`self.model.layers[...]` -> "model.layers" (None when not an attribute chain on self)."""
        names = []
        while True:
            if isinstance(node, ast.Subscript):
                node = node.value
            elif isinstance(node, ast.Attribute):
                names.append(node.attr)
                node = node.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                    "enumerate", "zip", "reversed") and node.args:
                node = node.args[0]
            else:
                break
        if isinstance(node, ast.Name) and node.id == "self" and names:
            return ".".join(reversed(names))
        return None

    def built_from(value):
        """The class name a `self.x = ...` value builds: `Qwen2MLP(config)`, `nn.ModuleList([Layer(c) ...])`."""
        for sub in ast.walk(value):
            if isinstance(sub, ast.Call):
                f = sub.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                if name and name not in ("ModuleList", "Sequential", "ModuleDict", "range", "len"):
                    return name
        return None

    def visit(node, cls, init=None):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, child.name)
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                # a function starts at its first decorator: frames may give that line (a profiler gives the
                # line where a Python function was entered for the operators it runs itself)
                first = min([d.lineno for d in child.decorator_list] + [child.lineno])
                out.functions.append((first, getattr(child, "end_lineno", child.lineno) or child.lineno,
                                      child.name, cls))
                loops.clear()
                visit(child, None, cls if child.name == "__init__" and cls else None)
                continue
            if init and isinstance(child, ast.Assign):
                for t in child.targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        name = built_from(child.value) or ""  # "": a module whose class the code does not say
                        known = out.attributes.setdefault(init, {})
                        if name or t.attr not in known:
                            known[t.attr] = name
            if isinstance(child, (ast.For, ast.AsyncFor)):
                source = chain(child.iter)
                target = child.target
                if isinstance(target, ast.Tuple) and target.elts:  # for i, layer in enumerate(self.layers)
                    target = target.elts[-1]
                if source and isinstance(target, ast.Name):
                    loops[target.id] = source
            if isinstance(child, ast.Call):
                fn = child.func
                line = child.lineno
                got = None
                if isinstance(fn, (ast.Attribute, ast.Subscript)):
                    c = chain(fn)
                    if c:
                        got = (c, isinstance(fn, ast.Subscript))
                elif isinstance(fn, ast.Name) and fn.id in loops:
                    got = (loops[fn.id], True)
                if (got is None and isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Call)
                        and isinstance(fn.value.func, ast.Name) and fn.value.func.id == "super"):
                    got = ("<super>", False)  # super().forward(...): the same module's base class
                if got:
                    for ln in range(line, (getattr(child, "end_lineno", line) or line) + 1):
                        out.calls.setdefault(ln, []).append(got)  # a call written over several lines too
            visit(child, cls, init)

    try:
        visit(tree, None, None)
    except RecursionError:
        return None
    return out
