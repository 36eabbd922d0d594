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
