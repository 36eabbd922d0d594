"""The typed seams: every compiled extension setup.py builds has a stub beside its C source that names what the
module holds, and the stub's names are the built module's (mypy checks the callers against the stubs; CI runs it)."""
import ast
import importlib
import re

import pytest

from .conftest import ROOT


def _extensions():
    text = (ROOT / "setup.py").read_text()
    return re.findall(r'Extension\("([\w.]+)", \["([\w/.]+\.c)"\]', text)


def test_every_extension_has_a_stub():
    exts = _extensions()
    assert {name for name, _ in exts} == {"tracekit.io._pkscan", "tracekit.analysis.allocator._replay",
                                           "tracekit.record._cpuhook"}
    for name, source in exts:
        assert (ROOT / source).with_suffix(".pyi").is_file(), f"{source}: no .pyi stub beside it"


@pytest.mark.parametrize("name,source", _extensions())
def test_the_stub_names_what_the_module_has(name, source):
    try:
        mod = importlib.import_module(name)
    except ImportError:
        pytest.skip(f"{name} is not built (no C compiler)")
    tree = ast.parse((ROOT / source).with_suffix(".pyi").read_text())
    stubbed = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    stubbed |= {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    public = {k for k in vars(mod) if not k.startswith("_")}
    assert stubbed == public, (name, sorted(stubbed ^ public))
