"""pytest plugin (registered by entry point): memory budgets and leak checks for tests.

    @pytest.mark.limit_peak_memory("512 MiB")                       # peak allocated, any device
    @pytest.mark.limit_peak_memory("2 GiB", device="cuda", category="activation")
    @pytest.mark.no_memory_leaks(iterations=5)
    def test_train_step(): ...

A marked test's body is recorded with `tracekit.record` (`device="cpu"`: the
CPU backend, `"cuda"`: the allocator's history, skipped without CUDA;
default: CUDA when available). A body that runs out of memory (raised, or
caught by the test itself but in the recording) always fails, with the
request, the free memory then, the cap and what held the memory, as
`tracekit check` says it. `limit_peak_memory` fails the test when the
peak allocated bytes (with `category`: that category's own peak, its most
bytes at any moment) exceed the limit, naming the categories and allocation
sites at the peak. `no_memory_leaks` runs the body
`iterations` times (>= 3; an iteration boundary after each call) and fails
when memory made in one call is still live calls later, step after step
(the report's leak finding, with the lines that allocate it).

`--tracekit-dir DIR` keeps the recordings of failing tests there (named
after the test); otherwise they are deleted.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile

import pytest

DEVICES = (None, "cpu", "cuda")


def pytest_addoption(parser):
    group = parser.getgroup("tracekit", "tracekit memory checks")
    group.addoption("--tracekit-dir", default=None, metavar="DIR",
                    help="keep the memory recordings of failing tracekit-marked tests in DIR")


def pytest_configure(config):
    config.addinivalue_line("markers", "limit_peak_memory(limit, device=None, category=None): fail the test when "
                                       "its peak allocated memory (or a category's own peak) exceeds limit")
    config.addinivalue_line("markers", "no_memory_leaks(iterations=5, device=None): run the test body `iterations` "
                                       "times and fail when memory grows step after step")


def _settings(item):
    """(limit, device, category, iterations) from the item's markers; None when unmarked."""
    peak, leaks = item.get_closest_marker("limit_peak_memory"), item.get_closest_marker("no_memory_leaks")
    if peak is None and leaks is None:
        return None
    from ..units import parse_bytes

    limit = category = None
    device = None
    if peak is not None:
        args = dict(zip(("limit", "device", "category"), peak.args), **peak.kwargs)
        if "limit" not in args:
            raise pytest.UsageError(f"{item.nodeid}: limit_peak_memory needs a limit, e.g. \"512 MiB\"")
        try:
            limit = parse_bytes(args["limit"]) if not isinstance(args["limit"], int) else args["limit"]
        except ValueError as e:
            raise pytest.UsageError(f"{item.nodeid}: limit_peak_memory: {e}") from None
        device, category = args.get("device"), args.get("category")
    iterations = None
    if leaks is not None:
        largs = dict(zip(("iterations",), leaks.args), **leaks.kwargs)
        iterations = int(largs.get("iterations", 5))
        if iterations < 3:
            raise pytest.UsageError(f"{item.nodeid}: no_memory_leaks needs iterations >= 3 (got {iterations})")
        device = device or largs.get("device")
    if device not in DEVICES:
        raise pytest.UsageError(f"{item.nodeid}: device must be 'cpu' or 'cuda', not {device!r}")
    return limit, device, category, iterations


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    settings = _settings(pyfuncitem)
    if settings is None:
        return None
    import inspect

    if inspect.iscoroutinefunction(pyfuncitem.obj):
        return None  # left to the async plugin, unrecorded
    limit, device, category, iterations = settings
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("tracekit: this memory check needs a CUDA device")
    from ..record import Recorder

    folder = tempfile.mkdtemp(prefix="tracekit-test-")
    path = os.path.join(folder, _file_name(pyfuncitem.nodeid))
    testargs = {arg: pyfuncitem.funcargs[arg] for arg in pyfuncitem._fixtureinfo.argnames}
    failed = True
    try:
        rec = Recorder(path, backend={"cpu": "cpu", "cuda": "cuda"}.get(device, "auto"), command=[pyfuncitem.nodeid])
        raised = None
        try:
            with rec:
                for _ in range(iterations or 1):
                    pyfuncitem.obj(**testargs)
                    if iterations:
                        rec.step()
        except Exception as e:  # noqa: BLE001 - an out-of-memory error is reported as tracekit's finding
            if not _is_oom(e) or not rec.written:
                raise
            raised = e
        if not rec.written:
            pytest.fail("tracekit: the test ran but its memory could not be recorded (see the warnings)",
                        pytrace=False)
        problems = check(rec.written, limit, device, category, leaks=iterations is not None)
        if raised is not None and "out of memory" not in problems:
            problems = (problems + "\n" if problems else "") + f"tracekit: out of memory: {type(raised).__name__}: {raised}"
        if problems:
            pytest.fail(problems + _kept(pyfuncitem, rec.written), pytrace=False)
        failed = False
    finally:
        if failed and os.path.exists(path):
            _keep(pyfuncitem, path)
        shutil.rmtree(folder, ignore_errors=True)
    return True


def _is_oom(e: BaseException) -> bool:
    """An out-of-memory error (torch.cuda.OutOfMemoryError, or the CPU allocator's "can't allocate memory")."""
    from ..analysis.oom import parse_error

    return type(e).__name__ == "OutOfMemoryError" or parse_error(str(e)) is not None


def check(path, limit, device, category, leaks) -> str:
    """The explanation of what ran out of memory, is over budget or leaking in a recording ("" when all is
    well). An out-of-memory error always fails, with the request, the free memory then, the cap and the top
    holders."""
    from ..analysis.report import build_report
    from ..analysis.budget import over_budget
    from ..io import load
    from ..render.text import finding_lines

    trace = load(path, use_cache=False)
    report = build_report(trace)
    devices = [d for d in report["devices"] if device is None or d["label"].split(":")[0] == device]
    report = dict(report, devices=devices, findings=[f for f in report["findings"]
                                                      if f["device"] in {d["device"] for d in devices}])
    peak = limit if limit is not None and not category else None
    problems = over_budget(report, peak, None, {}, no_leaks=leaks)
    if category and limit is not None:
        problems += _category_over(trace, devices, category, limit)
    if not problems:
        return ""
    out = ["tracekit: " + "; ".join(p["message"] for p in problems)]
    for d in devices:
        if not any(p["device"] == d["device"] and p["what"] not in ("leak", "oom") for p in problems):
            continue
        cats = sorted(((c, b) for c, b in (d.get("categories_at_peak") or {}).items() if b), key=lambda kv: -kv[1])
        from ..analysis.frames import where
        from ..units import fmt_bytes

        if cats:
            out.append(f"  {d['label']} at the peak, by category: "
                       + ", ".join(f"{c} {fmt_bytes(b)}" for c, b in cats[:5]))
        if d.get("top_stacks_at_peak"):
            out.append("  live at the peak, by allocation site:")
            out += [f"    {fmt_bytes(s['bytes']):>10} {s['count']:>5}x  {where(s['frames'])}"
                    for s in d["top_stacks_at_peak"][:5]]
    for f in report["findings"]:
        if leaks and f["kind"] == "leak":
            out += ["  " + line for line in finding_lines(f)[1:]]  # the summary is in the first line already
    return "\n".join(out)


def _category_over(trace, devices, category, limit) -> list[dict]:
    """A category's own peak (its most bytes at any entry, not only at the overall peak) over `limit`."""
    from ..analysis.timeline import category_series
    from ..units import fmt_bytes

    out = []
    for d in devices:
        series = category_series(trace, d["device"]).by_category
        if category not in series:
            raise pytest.UsageError(f"limit_peak_memory: no category {category!r} (known: {', '.join(series)})")
        got = int(series[category].max()) if len(series[category]) else 0
        if got > limit:
            out.append({"what": category, "device": d["device"], "bytes": got, "limit": limit,
                        "message": f"{d['label']}: {category} peaked at {fmt_bytes(got)} > {fmt_bytes(limit)} "
                                   f"(over by {fmt_bytes(got - limit)})"})
    return out


def _file_name(nodeid):
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_")[:150] + ".pickle"


def _keep(item, path):
    folder = item.config.getoption("tracekit_dir")
    if not folder:
        return None
    os.makedirs(folder, exist_ok=True)
    dest = os.path.join(folder, os.path.basename(path))
    shutil.copyfile(path, dest)
    return dest


def _kept(item, path):
    folder = item.config.getoption("tracekit_dir")
    if not folder:
        return "\n  (run with --tracekit-dir DIR to keep the recording)"
    return f"\n  recording: {os.path.join(folder, os.path.basename(path))}  (tracekit view / report it)"
