"""Packages: tracekit and its subpackages, and the viewer's folder gui/ installed as `tracekit_gui`;
the optional compiled pickle scanner (tracekit/io/_pkscan.c), the allocator replay
(tracekit/analysis/allocator/_replay.c), and the optional CPU allocation hook of the recorder
(tracekit/record/_cpuhook.c, Linux only: elsewhere it builds a stub that says so).

Everything else (name, version, dependencies) is in pyproject.toml. This file exists
only because pyproject.toml cannot both find packages and rename one, nor declare an
extension whose build may fail: without a C compiler the install still succeeds and
tracekit reads snapshots with the pure-Python restricted unpickler and records the CPU with
torch.profiler.
"""
from setuptools import Extension, find_packages, setup

setup(packages=find_packages(include=["tracekit", "tracekit.*"]) + ["tracekit_gui"],
      package_dir={"tracekit_gui": "gui"},
      ext_modules=[Extension("tracekit.io._pkscan", ["tracekit/io/_pkscan.c"], optional=True),
                   Extension("tracekit.analysis.allocator._replay", ["tracekit/analysis/allocator/_replay.c"],
                             optional=True),
                   Extension("tracekit.record._cpuhook", ["tracekit/record/_cpuhook.c"], optional=True)])
