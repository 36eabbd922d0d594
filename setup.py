"""Packages: tracekit and its subpackages, and the viewer's folder gui/ installed as `tracekit_gui`.

Everything else (name, version, dependencies) is in pyproject.toml. This file exists
only because pyproject.toml cannot both find packages and rename one.
"""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["tracekit", "tracekit.*"]) + ["tracekit_gui"],
      package_dir={"tracekit_gui": "gui"})
