"""Issue 31 in the viewer: the same facts as the report, from the same functions (offscreen Qt)."""
import pytest

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from tests.conftest import ROOT  # noqa: E402
from tests.test_gui import _cache_dir, open_and_wait, settings_file, window  # noqa: E402,F401

CUDA = ROOT / "tests" / "fixtures" / "cuda"


def test_library_line_groups_take_the_reports_category_and_the_headline(window, qtbot):  # noqa: F811
    from tracekit.analysis.libraries import library_where
    from tracekit.units import fmt_bytes

    view = open_and_wait(window, qtbot, CUDA / "qwen2_amp_adamw_b4_s256.pickle.gz")
    report = view.doc.device_report(view.device)
    # the summary line leads with the report's headline: max_memory_allocated, exact, requested beside it
    head = report["headline_peak"]
    text = view.summary.text()
    assert f"peak allocated <b>{fmt_bytes(head['bytes'])}</b> (exact, as torch.cuda.max_memory_allocated()" in text
    assert f"tensors requested {fmt_bytes(head['requested_bytes'])}" in text
    view.group_by("library")
    g = view.groups
    shown = {g.index(r, 4).data(): g.index(r, 3).data() for r in range(g.rowCount())}
    checked = 0
    seen = set()
    for row in report["library_sites_at_peak"]:  # largest first: each line's main category at the peak
        where = library_where(row)
        if where in seen or where not in shown:
            continue
        seen.add(where)
        assert shown[where].replace(" ", "_") == row["category"], (where, shown[where], row["category"])
        checked += 1
    assert checked >= 3


def test_the_legend_wraps_instead_of_cutting_names(window, qtbot):  # noqa: F811
    view = open_and_wait(window, qtbot, CUDA / "qwen2_amp_adamw_b4_s256.pickle.gz")
    legend = view.timeline.legend
    assert {"parameter", "optimizer state", "temporary", "workspace"} <= set(legend.texts)
    one_line = legend.label.fontMetrics().height()
    assert legend.label.heightForWidth(300) > 2 * one_line  # narrow: more lines, every name whole
    assert "optimizer&nbsp;state" in legend.label.text()


def _compiled_run(tmp_path, compiled=True):
    """Three training iterations; the first begins with a 30 s compile (what torch.compile's first call costs)."""
    import itertools
    import pickle

    from tests.synth import Sim

    torch_dir = "/opt/venv/lib/python3.11/site-packages/torch"
    gen = ({"filename": "/tmp/torchinductor_u/ab/cabcdef.py", "line": 310, "name": "call"} if compiled
           else {"filename": f"{torch_dir}/nn/functional.py", "line": 2000, "name": "linear"})
    fwd = [gen, {"filename": f"{torch_dir}/nn/modules/module.py", "line": 1884, "name": "_call_impl"},
           {"filename": "/home/u/train.py", "line": 20, "name": "<module>"}]
    bwd = [{"filename": f"{torch_dir}/autograd/graph.py", "line": 979, "name": "_engine_run_backward"},
           {"filename": "/home/u/train.py", "line": 21, "name": "<module>"}]
    opt = [{"filename": f"{torch_dir}/optim/adamw.py", "line": 300, "name": "step"},
           {"filename": "/home/u/train.py", "line": 22, "name": "<module>"}]
    sim = Sim()
    for it in range(3):
        acts = [sim.alloc(4 << 20, frames=fwd)]
        if it == 0:  # the compile: 30 s before the next kernel runs
            sim.clock = itertools.count(next(sim.clock) + 30_000_000, 7)
        acts += [sim.alloc(4 << 20, frames=fwd) for _ in range(2)]
        g = sim.alloc(1 << 20, frames=bwd)
        for a in acts:
            sim.free(a)
        o = sim.alloc(1 << 20, frames=opt)
        sim.free(o)
        sim.free(g)
    path = tmp_path / ("compiled_run.pickle" if compiled else "eager_run.pickle")
    path.write_bytes(pickle.dumps(sim.snapshot()))
    return path


def test_the_compile_warm_up_stays_out_of_the_opening_view(window, qtbot, tmp_path):  # noqa: F811
    from tracekit.analysis.phases import phases
    from tracekit.analysis.warmup import compile_warmup
    from tracekit.io import load

    path = _compiled_run(tmp_path)
    trace = load(path, use_cache=False)
    its = phases(trace)[0].iterations()
    assert [i for i, *_ in its] == [0, 1, 2]
    warm = compile_warmup(trace, 0)
    assert warm is not None and warm["last_index"] == its[1][1] - 1 and warm["seconds"] > 29
    assert compile_warmup(load(_compiled_run(tmp_path, compiled=False), use_cache=False), 0) is None
    view = open_and_wait(window, qtbot, path)
    (x0, x1), _ = view.timeline.vb.viewRange()
    start1 = view.doc.x_of(0, its[1][1])
    assert start1 - 0.01 * (x1 - start1) <= x0 < start1 + 1e-3 and x1 >= view.doc.x_range(0)[1] - 1e-3
    assert "compile warm-up" in view.timeline.legend.texts
