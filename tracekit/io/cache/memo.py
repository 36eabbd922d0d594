"""Analysis results kept in the cache beside a trace's columns, so a warm open skips the analysis.

The analyses memoise their results on the trace they analyse (analysis/memo.py). Once the viewer has
analysed a file, `store` writes that memo (replay, categories, phases, sites, the timeline's step
functions) and the report to one entry under the file's key, the window and tracekit's code
(folder.code_stamp), in the columns' layout (traces.py: arrays memory-mapped on read, CRCs).
`restore` puts it back on a freshly loaded trace, so the same calls find their results instead of
computing them. Values are dataclasses defined in tracekit, numpy arrays (object arrays of strings too),
slices and plain data; a memo entry holding anything else is left out (computed again when asked for).
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import os
import tempfile

import numpy as np

from ...model import Trace
from . import folder, traces
from .folder import code_stamp

SUFFIX = ".tkm"


class Unstorable(Exception):
    """A value this store does not write (it is computed again when needed)."""


def _name(window, code="") -> str:
    return f"analysis code={code_stamp()}{code} window={window!r}"


def _file(key, window, code="") -> str:
    digest = hashlib.sha256(_name(window, code).encode()).hexdigest()[:16]
    return os.path.join(folder.cache_dir(), f"{key}-{digest}{SUFFIX}")


def store(trace: Trace, path, window=None, extra=None, code="", leave_out=()) -> bool:
    """Write `trace`'s memo (and `extra`, plain data such as the report) for `path` cut to `window`;
    `code` names the code that made `extra` when it is not tracekit's (folder.code_stamp(package folder));
    `leave_out`: memo keys not to write (stored already under another code: the viewer writes its analysis
    under tracekit's as soon as it has it, its extras and what it analysed since under its own).
    Only while the trace's own entry is cached; failures are ignored (the cache is an optimisation)."""
    folder.wait_written()  # the entry load(write_behind=True) is writing
    key = folder.known_key(path) or folder.key_for(path)
    if not key or not os.path.isfile(folder._file(key)):
        return False
    arrays: dict
    seen: dict
    arrays, seen, entries = {}, {}, []
    for k, v in list(trace.__dict__.get("_memo", {}).items()):
        if k in leave_out:
            continue
        try:
            entries.append([traces.encode(k), _enc(v, arrays, seen)])
        except (Unstorable, TypeError, RuntimeError):  # RuntimeError: a dict the analysis grows meanwhile
            continue
    try:
        extra_enc = _enc(extra or {}, arrays, seen)
    except (Unstorable, TypeError):
        return False
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=folder.cache_dir(), suffix=".tmp")
        os.close(fd)
        # not read back: restore's unpack checks every column's sum (a damaged entry is a miss, computed again)
        traces.pack(tmp, arrays, {"name": _name(window, code), "memo": entries, "extra": extra_enc}, verify=False)
        os.replace(tmp, _file(key, window, code))
        _drop_older(key, code)
        tmp = None
        traces.evict(traces.max_bytes())
        return True
    except (OSError, ValueError, TypeError, folder.Odd, MemoryError):
        return False
    finally:
        if tmp:
            folder._unlink(tmp)


def restore(trace: Trace, path, window=None, code=""):
    """Put the stored memo back on `trace` (freshly loaded from `path`, cut to `window`) and return the
    stored `extra`; None (nothing changed) when there is none or it is odd (then it is deleted)."""
    key = folder.known_key(path)
    if not key:
        return None
    fn = _file(key, window, code)
    if not os.path.isfile(fn):
        return None
    try:
        head, arrays = traces.unpack(fn)
        if head.get("name") != _name(window, code) or not isinstance(head.get("memo"), list):
            raise folder.Odd("another entry")
        memo = {}
        for k, v in head["memo"]:
            k = traces.decode(k)
            if not (isinstance(k, tuple) and len(k) == 3 and str(k[0]).startswith("tracekit.")):
                raise folder.Odd("not a memo key")
            memo[k] = _dec(v, arrays)
        extra = _dec(head.get("extra"), arrays)
    except Exception:  # whatever is wrong with it, it is a miss
        folder._unlink(fn)
        return None
    mine = trace.__dict__.setdefault("_memo", {})
    for k, v in memo.items():
        mine.setdefault(k, v)
    folder._touch(folder._file(key))
    return extra


def _drop_older(key, code) -> None:
    """Delete this trace's stored analyses made by other versions of the code (they can never be read)."""
    d = folder.cache_dir()
    current = [f'"analysis code={code_stamp()}{c} window='.encode() for c in ("", code)]
    if not code:  # tracekit's own entry leaves this version's entries of other code (the viewer's) alone
        current.append(f'"analysis code={code_stamp()} '.encode())
    for name in os.listdir(d):
        if name.startswith(key + "-") and name.endswith(SUFFIX):
            try:
                with folder.open_regular(os.path.join(d, name)) as f:
                    head = f.read(4096)
            except OSError:
                continue
            if not any(c in head for c in current):
                folder._unlink(os.path.join(d, name))


# -- values <-> JSON + arrays: every dict in the JSON is a tag ----------------------------------------

def _enc(v, arrays, seen):
    if v is None or type(v) in (str, int, float, bool):
        return v
    if isinstance(v, np.ndarray):
        if v.dtype.hasobject:
            if v.ndim != 1 or not all(type(s) is str for s in v.tolist()):
                raise Unstorable("object array")
            return {"~S": v.tolist()}  # strings (site names)
        if _constant(v):  # written as its one value (the store's bytes are most of a big file's keep)
            return {"~k": _enc(v.reshape(-1)[0], arrays, seen), "shape": list(v.shape)}
        name = seen.get(id(v))
        if name is None:
            name = seen[id(v)] = f"a{len(arrays)}"
            arrays[name] = np.ascontiguousarray(v).reshape(-1)
        return {"~a": name, "shape": list(v.shape)}
    if isinstance(v, np.generic):
        return {"~n": v.dtype.str, "v": v.item()}
    if type(v) is slice:
        return {"~s": [_enc(x, arrays, seen) for x in (v.start, v.stop, v.step)]}
    if type(v) in (list, tuple):
        return {"~l" if type(v) is list else "~t": [_enc(x, arrays, seen) for x in v]}
    if type(v) in (dict, set, frozenset) or type(v) is bytes:
        if type(v) is dict:
            return {"~d": [[_enc(k, arrays, seen), _enc(x, arrays, seen)] for k, x in v.items()]}
        return {"~p": traces.encode(v)}
    if dataclasses.is_dataclass(v) and not isinstance(v, (type, Trace)):
        cls = type(v)
        if not cls.__module__.startswith("tracekit.") or not hasattr(v, "__dict__"):
            raise Unstorable(cls.__name__)
        fields = {k: _enc(x, arrays, seen) for k, x in vars(v).items()}
        return {"~c": f"{cls.__module__}:{cls.__qualname__}", "f": fields}
    raise Unstorable(type(v).__name__)


CONSTANT_MIN = 1 << 16  # elements from which an array of one value is stored as that value


def _constant(a: np.ndarray) -> bool:
    """Whether `a` (integers or booleans, at least CONSTANT_MIN of them) holds one value throughout (floats are
    written whole: 0.0 == -0.0)."""
    if a.size < CONSTANT_MIN or a.dtype.kind not in "biu":
        return False
    flat = a.reshape(-1)
    first = flat[0]
    return bool(flat[-1] == first and (flat[:64] == first).all() and (flat == first).all())


def _dec(v, arrays):
    if not isinstance(v, (dict, list)):
        return v
    if "~a" in v:
        return arrays[v["~a"]].reshape(v["shape"])
    if "~k" in v:
        one = _dec(v["~k"], arrays)
        if not isinstance(one, np.generic):
            raise folder.Odd("not a constant")
        return np.full(v["shape"], one, dtype=one.dtype)  # writable, as a mapped column is
    if "~S" in v:
        out = np.empty(len(v["~S"]), dtype=object)
        out[:] = v["~S"]
        return out
    if "~n" in v:
        return np.dtype(v["~n"]).type(v["v"])
    if "~l" in v:
        return [_dec(x, arrays) for x in v["~l"]]
    if "~s" in v:
        return slice(*(_dec(x, arrays) for x in v["~s"]))
    if "~t" in v:
        return tuple(_dec(x, arrays) for x in v["~t"])
    if "~d" in v:
        return {_dec(k, arrays): _dec(x, arrays) for k, x in v["~d"]}
    if "~p" in v:
        return traces.decode(v["~p"])
    if "~c" in v:
        module, qualname = v["~c"].split(":")
        if not module.startswith("tracekit."):
            raise folder.Odd(module)
        cls = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise folder.Odd(qualname)
        obj = object.__new__(cls)
        obj.__dict__.update({k: _dec(x, arrays) for k, x in v["f"].items()})
        return obj
    raise folder.Odd("unknown tag")
