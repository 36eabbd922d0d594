"""The shape of the house (docs/architecture.md), read from the code's own imports: every import in
tracekit/ and gui/ (module level or inside a function) goes down the layers, never up; no two modules
import each other, directly or round a circle; the package root holds only entry points and the shared
model; Qt only in gui/, torch only where a recorder runs it."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lower number = lower layer. A module may import its own layer or lower ones, never a higher one.
LAYERS = [
    (0, ("tracekit.errors", "tracekit.units", "tracekit.model")),
    (1, ("tracekit.io",)),
    (2, ("tracekit.analysis",)),
    (3, ("tracekit.render",)),
    (4, ("tracekit.record", "tracekit.simulate", "tracekit.commands", "tracekit.integrations", "tracekit.api",
         "tracekit.data")),
    (5, ("tracekit.cli", "tracekit.__main__", "tracekit")),
    (6, ("gui",)),
]
ROOT_MODULES = {"__init__", "__main__", "api", "cli", "errors", "model", "units"}


def layer(module: str) -> int:
    best, best_len = None, -1
    for rank, prefixes in LAYERS:
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = rank, len(p)
    assert best is not None, f"{module} is in no layer of docs/architecture.md"
    return best


def modules() -> dict:
    out = {}
    for pkg in ("tracekit", "gui"):
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    out[name[:-9] if name.endswith(".__init__") else name] = path
    return out


def imports(mods: dict) -> dict:
    """{module: {(imported module, external top-level name or None)}} for every import statement."""
    graph = {}
    for m, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        found = set()
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = m.split(".")[: len(m.split(".")) - node.level + (1 if is_pkg else 0)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in names:
                t = {"tracekit_gui": "gui"}.get(t.split(".")[0], t.split(".")[0]) + t[len(t.split(".")[0]):]
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                found.add(t or None)
                if not t:
                    top = names[0].split(".")[0]
                    found.add(("external", top))
        graph[m] = found
    return graph


def test_imports_go_down_the_layers():
    mods = modules()
    up = []
    for m, targets in imports(mods).items():
        for t in targets:
            if isinstance(t, str) and t != m and layer(t) > layer(m):
                up.append(f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})")
    assert not up, "imports that go up a layer:\n" + "\n".join(sorted(up))


def test_no_import_circles():
    mods = modules()
    graph = {m: {t for t in ts if isinstance(t, str) and t != m
                 and not (mods[m].endswith("__init__.py") and t.startswith(m + "."))}  # a package re-exporting
             for m, ts in imports(mods).items()}
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, circles


def test_the_package_root_holds_entry_points_and_the_shared_model():
    loose = {f[:-3] for f in os.listdir(os.path.join(ROOT, "tracekit")) if f.endswith(".py")}
    assert loose <= ROOT_MODULES and len(loose) <= 8, sorted(loose - ROOT_MODULES)


def test_nothing_inside_imports_the_package_root():
    mods = modules()
    bad = sorted(f"{m} -> {t}" for m, ts in imports(mods).items() for t in ts
                 if t in ("tracekit", "gui") and m.startswith(t + "."))
    assert not bad, bad


def test_qt_only_in_the_viewer_and_torch_only_where_it_runs():
    qt, torch = [], []
    mods = modules()
    for m, path in mods.items():
        text = open(path, encoding="utf-8").read()
        for node in ast.walk(ast.parse(text)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for n in names:
                top = n.split(".")[0]
                if top in ("PySide6", "pyqtgraph", "tracekit_gui") and not m.startswith("gui"):
                    qt.append(f"{m} imports {n}")
                if top == "torch" and m.split(".")[:2] in (["tracekit", "io"], ["tracekit", "analysis"],
                                                          ["tracekit", "render"], ["tracekit", "model"]):
                    torch.append(f"{m} imports {n}")
    assert not qt, qt
    assert not torch, torch
