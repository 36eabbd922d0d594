"""Packages: tracekit and its subpackages, and the viewer's folder gui/ installed as `tracekit_gui`;
and the optional compiled pickle scanner (tracekit/io/_pkscan.c) and allocator replay
(tracekit/analysis/allocator/_replay.c).

Everything else (name, version, dependencies) is in pyproject.toml. This file exists
only because pyproject.toml cannot both find packages and rename one, nor declare an
extension whose build may fail: without a C compiler the install still succeeds and
tracekit reads snapshots with the pure-Python restricted unpickler.
"""
from setuptools import Extension, find_packages, setup

setup(packages=find_packages(include=["tracekit", "tracekit.*"]) + ["tracekit_gui"],
      package_dir={"tracekit_gui": "gui"},
      ext_modules=[Extension("tracekit.io._pkscan", ["tracekit/io/_pkscan.c"], optional=True),
                   Extension("tracekit.analysis.allocator._replay", ["tracekit/analysis/allocator/_replay.c"],
                             optional=True)])
