"""The cache folder's files and their names, without numpy: where the folder is, the key of a file's
content (remembered under the file's fingerprint, see traces.py), JSON results stored beside a
cached trace, and the stamp of tracekit's own code that results are keyed on. Light on purpose: a
`report --json` served from the cache imports only this and reports.py."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat as _stat
import sys
import tempfile
import threading
import time
import zlib

VERSION = 7  # bump whenever Trace, meta or the entry layout changes (5: origins, 6: memory-mapped columns,
# 7: a checksum over each whole column, a CRC-32 over each stored result)
SUFFIX = ".tkc"
SAMPLE = 64 * 1024  # bytes read at each end of a file for its fingerprint
HASH_AHEAD_BYTES = 64 << 20  # a file this big or bigger, not opened before, is hashed while it is read
RACY_S = 2.0  # a file whose times are this close to now is hashed every time (a clock tick may hide an edit)


class Odd(Exception):
    """A cache file that is not exactly what tracekit writes."""


def cache_dir() -> str:
    if os.environ.get("TRACEKIT_CACHE_DIR"):
        return os.environ["TRACEKIT_CACHE_DIR"]
    if sys.platform == "darwin":
        return os.path.expanduser("~/Library/Caches/tracekit")
    if sys.platform == "win32":
        return os.path.join(os.environ.get("LOCALAPPDATA", os.path.expanduser("~")), "tracekit", "Cache")
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tracekit")


def open_regular(path):
    """Open a file for reading without ever blocking: a FIFO, device or socket raises OSError."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags)
    try:
        if not _stat.S_ISREG(os.fstat(fd).st_mode):
            raise IsADirectoryError(f"{os.fsdecode(path)} is not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


# -- keys ---------------------------------------------------------------------------------------------

def key_for(path, stat=None) -> str | None:
    """Identity of the file's current content (a hash of all of it), or None if it cannot be read.
    Remembered under the file's fingerprint (see traces.py), so a warm open hashes 128 KiB.
    `stat` is not used (the open file's own fstat is: it cannot change between stat and read)."""
    return _key_for(path, True)


def _key_for(path, wait) -> str | None:
    """key_for; `wait`: for the hashing key_soon started (False: in that hashing's own thread)."""
    try:
        with open_regular(path) as f:
            st = os.fstat(f.fileno())
            fp = _fingerprint(f, st)
            known = ((_once or {}).get(fp) or _remembered(fp)) if fp else None
            if isinstance(known, Hashing):  # being hashed (key_soon): wait for it
                if wait:
                    return known.result()
                known = None
            if known:
                return known
            f.seek(0)
            h = hashlib.sha256(f"tracekit-cache {VERSION} {st.st_size}\n".encode())
            while chunk := f.read(4 * 2**20):
                h.update(chunk)
            key = h.hexdigest()[:40]
            if fp and os.fstat(f.fileno()).st_ctime_ns == st.st_ctime_ns:  # not written to while hashed
                _remember(fp, key)
                once = _once
                if once is not None:
                    once[fp] = key
            return key
    except (OSError, ValueError):
        return None


writing: list[threading.Thread] = []  # the threads writing entries (traces.write_soon)


def wait_written() -> None:
    """Wait for the entries traces.write_soon is writing (from any thread: each waits for all of them, not only
    for those no other waiter has taken)."""
    join_all(writing)


def join_all(threads: list) -> None:
    """Join every thread of `threads` (a list other threads add to and wait on), taking each off as it ends;
    each waiter waits for all of them, not only for those no other waiter has taken."""
    while threads:
        try:
            t = threads[0]
        except IndexError:
            break
        t.join()
        try:
            threads.remove(t)
        except ValueError:  # another waiter took it off
            pass


_once: dict[str, str | Hashing] | None = None  # fingerprint -> key (or its hashing), inside hashed_once()


class Hashing:
    """A file's key: known, or being hashed by a thread of its own (hashlib and reads let go of the GIL, so
    it takes the second core while the file is read and converted)."""

    def __init__(self, path=None, key=None):
        self.key, self._thread = key, None
        if path is not None:
            self._thread = threading.Thread(target=self._run, args=(path,), name="tracekit-key", daemon=True)
            self._thread.start()

    def _run(self, path):
        self.key = _key_for(path, False)

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def result(self) -> str | None:
        if self._thread is not None:
            self._thread.join()
        return self.key


def key_soon(path) -> Hashing:
    """key_for(path): known at once when the file's fingerprint is remembered or the file is smaller than
    HASH_AHEAD_BYTES, else hashed in the background (done() says which) while the caller reads the file;
    inside hashed_once() a later key_for waits for it."""
    try:
        with open_regular(path) as f:
            st = os.fstat(f.fileno())
            fp = _fingerprint(f, st)
    except (OSError, ValueError):
        return Hashing(key=None)
    known = ((_once or {}).get(fp) or _remembered(fp)) if fp else None
    if isinstance(known, Hashing):
        return known
    if known:
        return Hashing(key=known)
    pending = Hashing(path)
    if fp and _once is not None:
        _once[fp] = pending
    if st.st_size < HASH_AHEAD_BYTES:
        pending.result()  # a smaller file: its key first (a copy of a cached file is then read from the cache)
    return pending


@contextlib.contextmanager
def hashed_once():
    """Inside it, key_for hashes a file (by its fingerprint) at most once: a first `report` asks for the key
    before reading (is the report or the trace cached?), again in load, and after (did the file change
    meanwhile?), all before the entry that makes the remembered fingerprint count is written."""
    global _once
    outer = _once
    if outer is None:
        _once = {}
    try:
        yield
    finally:
        _once = outer


def known_key(path) -> str | None:
    """The key of a file whose cached entry is there and whose fingerprint is remembered, else None;
    never reads more than the file's ends."""
    try:
        with open_regular(path) as f:
            fp = _fingerprint(f, os.fstat(f.fileno()))
            return _remembered(fp) if fp else None
    except (OSError, ValueError):
        return None


def _fingerprint(f, st) -> str | None:
    """A hash of what identifies this version of an open file without reading it all; None where the
    times cannot vouch for it (Windows' ctime is the creation time; times within a clock tick of now)."""
    if sys.platform == "win32" or time.time() - max(st.st_mtime, st.st_ctime) < RACY_S:
        return None
    h = hashlib.sha256(f"{VERSION} {st.st_dev} {st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}\n"
                       .encode())
    h.update(f.read(SAMPLE))
    if st.st_size > SAMPLE:
        f.seek(max(SAMPLE, st.st_size - SAMPLE))
        h.update(f.read(SAMPLE))
    return h.hexdigest()[:40]


def _fp_file(fp) -> str:
    return os.path.join(cache_dir(), "fp", fp)


def _remembered(fp) -> str | None:
    """The content key remembered for a fingerprint, if its entry is still there."""
    try:
        with open_regular(_fp_file(fp)) as f:
            key = f.read(64).decode("ascii")
    except (OSError, ValueError):
        return None
    if len(key) == 40 and all(c in "0123456789abcdef" for c in key) and os.path.isfile(_file(key)):
        return key
    return None


def _remember(fp, key) -> None:
    try:
        os.makedirs(os.path.dirname(_fp_file(fp)), exist_ok=True)
        _atomic(_fp_file(fp), key.encode())
    except OSError:
        pass


def _atomic(fn, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(fn), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, fn)
    except BaseException:
        _unlink(tmp)
        raise


def _file(key) -> str:
    return os.path.join(cache_dir(), f"{key}{SUFFIX}")


# -- results computed from a trace --------------------------------------------------------------------

def _result_file(key, name) -> str:
    return os.path.join(cache_dir(), f"{key}-{hashlib.sha256(name.encode()).hexdigest()[:16]}.json")


def value_crc(value) -> int:
    """The CRC-32 a stored result carries: of its value as JSON (as json.dumps writes it; a damaged byte
    anywhere in the value changes what is read back, hence this)."""
    return zlib.crc32(json.dumps(value).encode())


def result(key, name):
    """A result stored with `store_result(key, name, value)` while the trace's entry exists, else None
    (also when its CRC-32 does not match: the file is deleted and the result computed and stored again)."""
    fn = _result_file(key, name)
    try:
        with open_regular(fn) as f:
            doc = json.loads(f.read().decode())
        if not (isinstance(doc, dict) and doc.get("name") == name and "value" in doc and os.path.isfile(_file(key))):
            raise Odd("not ours")
        if type(doc.get("crc")) is not int or value_crc(doc["value"]) != doc["crc"]:
            raise Odd("damaged")
    except FileNotFoundError:
        return None
    except Exception:
        _unlink(fn)
        return None
    _touch(_file(key))
    return doc["value"]


def store_result(key, name, value) -> None:
    """Keep a JSON-ready `value` computed from the trace `key` names (with everything else it depends on
    in `name`); it goes when the trace's entry goes. Failures are ignored."""
    try:
        if os.path.isfile(_file(key)):
            doc = {"name": name, "crc": value_crc(value), "value": value}
            _atomic(_result_file(key, name), json.dumps(doc).encode())
    except (OSError, TypeError, ValueError):
        pass


def _touch(fn) -> None:
    try:
        os.utime(fn)  # "recently used" for eviction, whatever the filesystem's atime policy
    except OSError:
        pass


def _unlink(fn) -> bool:
    try:
        os.unlink(fn)
        return True
    except OSError:
        return False


_STAMP = None
_STAMPS: dict = {}
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tracekit/


def code_stamp(root=None) -> str:
    """A hash of the name, size and mtime of every module of the installed tracekit package (or of the
    package folder `root`, for code outside tracekit whose results are stored too: the viewer's)."""
    global _STAMP
    if root is None and _STAMP is not None:
        return _STAMP
    folder0 = root or PACKAGE_DIR
    if folder0 not in _STAMPS:
        h = hashlib.sha256(str(VERSION).encode())
        for folder, dirs, files in os.walk(folder0):
            dirs.sort()
            for name in sorted(files):
                if name.endswith((".py", ".so", ".pyd", ".toml", ".json")):
                    st = os.stat(os.path.join(folder, name))
                    h.update(f"{os.path.relpath(os.path.join(folder, name), folder0)} {st.st_size} {st.st_mtime_ns}\n"
                             .encode())
        _STAMPS[folder0] = h.hexdigest()[:16]
    if root is None:
        _STAMP = _STAMPS[folder0]
    return _STAMPS[folder0]
