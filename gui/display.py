"""Can the viewer open a window here? Checked before Qt starts, without importing Qt.

On Linux with an X display Qt loads its xcb platform plugin, which needs system
libraries a fresh Debian/Ubuntu lacks (libxcb-icccm4, libxcb-keysyms1,
libxcb-cursor0, ...). Without them Qt aborts with "could not load the Qt
platform plugin". `problem()` finds the missing libraries first (ldd on the
plugin, plus the one Qt loads at run time) and says in one line what to install.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import shutil
import subprocess
import sys

# The libraries Qt's xcb plugin needs beyond a basic X11 system (Qt's own list, and what ldd shows).
XCB_PACKAGES = ("libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1 libxcb-image0 libxcb-render-util0 libxcb-randr0 "
                "libxcb-shape0 libxcb-xkb1 libxkbcommon-x11-0 libegl1 libfontconfig1 libdbus-1-3").split()
# Loaded by Qt at run time (dlopen), so ldd does not list it.
RUNTIME_LIBRARIES = ("libxcb-cursor.so.0",)
# Debian package names that do not follow the soname rule in `debian_package`.
_PACKAGE_EXCEPTIONS = {"libglib-2.0.so.0": "libglib2.0-0", "libgthread-2.0.so.0": "libglib2.0-0",
                       "libz.so.1": "zlib1g", "libharfbuzz.so.0": "libharfbuzz0b", "libGLdispatch.so.0": "libglvnd0",
                       "libbrotlidec.so.1": "libbrotli1", "libbrotlicommon.so.1": "libbrotli1"}


def debian_package(soname: str) -> str:
    """The Debian/Ubuntu package that ships a library: libxcb-icccm.so.4 -> libxcb-icccm4."""
    if soname in _PACKAGE_EXCEPTIONS:
        return _PACKAGE_EXCEPTIONS[soname]
    m = re.fullmatch(r"(lib.+?)\.so\.(\d+)(?:\..*)?", soname)
    if not m:
        return soname
    base, version = m.group(1).lower(), m.group(2)
    return f"{base}-{version}" if base[-1].isdigit() else f"{base}{version}"


def xcb_plugin() -> str | None:
    """Path of PySide6's libqxcb.so, found without importing PySide6 (None when absent)."""
    spec = importlib.util.find_spec("PySide6")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "Qt", "plugins", "platforms", "libqxcb.so")
        if os.path.exists(path):
            return path
    return None


def missing_libraries(plugin: str) -> list[str]:
    """Sonames the plugin needs that the dynamic loader cannot find (ldd, plus run-time loads)."""
    missing = []
    if shutil.which("ldd"):
        out = subprocess.run(["ldd", plugin], capture_output=True, text=True, timeout=30).stdout
        missing = [line.split()[0] for line in out.splitlines() if "not found" in line]
    for name in RUNTIME_LIBRARIES:
        try:
            ctypes.CDLL(name)
        except OSError:
            missing.append(name)
    return list(dict.fromkeys(missing))


def uses_xcb(environ=os.environ) -> bool:
    """Whether Qt will pick the xcb plugin: Linux, an X display, no other platform asked for, not Wayland."""
    if not sys.platform.startswith("linux"):
        return False
    asked = environ.get("QT_QPA_PLATFORM", "")
    if asked:
        return asked.split(":")[0].split(";")[0] == "xcb"
    wayland = environ.get("WAYLAND_DISPLAY") and environ.get("XDG_SESSION_TYPE") == "wayland"
    return bool(environ.get("DISPLAY")) and not wayland


def missing_packages() -> str | None:
    """One line naming the viewer's Python packages that are not installed, or None."""
    missing = [m for m in ("PySide6", "pyqtgraph") if importlib.util.find_spec(m) is None]
    if missing:
        return f"the viewer needs {' and '.join(missing)}: pip install 'torch-tracekit[gui]'"
    return None


def problem(environ=os.environ) -> str | None:
    """One line saying why a window cannot open here and what to install, or None when it can."""
    if not uses_xcb(environ):
        return None
    plugin = xcb_plugin()
    if plugin is None:
        return None  # no PySide6 here: the caller's own import check says so
    missing = missing_libraries(plugin)
    if not missing:
        return None
    packages = " ".join(dict.fromkeys(debian_package(s) for s in missing))
    return (f"the viewer cannot open a window: Qt's xcb platform plugin needs system libraries that are missing "
            f"({', '.join(missing)}); on Debian/Ubuntu: sudo apt-get install {packages}")
