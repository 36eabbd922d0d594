"""Unit checks of the recorder's joins (record/origins.py: calls, backward ranges, the origin table), the
op log's stacks and module paths (record/oplog.py, record/stacks.py), the CUDA annotation of a snapshot
(record/cuda.py, on this machine's CPU with a synthetic history), and the per-module table
(analysis/modules.py)."""
import sys
import traceback
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tracekit.analysis.modules import _layers, group_peaks
from tracekit.record.origins import Calls, OriginTable, Ranges


def _row(k0, k1, stack=1, module=0, s0=0, s1=0, parent=-1, cid=0, container=False, t0=0, t1=0):
    return (k0, k1, t0, t1, stack, module, s0, s1, parent, cid, -1, container)


def test_calls_innermost_with_backward_containers():
    """A backward call (container) holds the engine's allocations; calls logged inside it (hooks,
    recomputation) hold their own; containers nest; keys outside every call belong to none."""
    rows = [_row(0, 5, stack=1, cid=0),
            _row(10, 40, stack=2, cid=1, container=True),
            _row(15, 18, stack=3, cid=2, parent=1),
            _row(20, 30, stack=4, cid=3, parent=1, container=True),  # a backward inside a backward
            _row(22, 24, stack=5, cid=4, parent=3),
            _row(50, 52, stack=6, cid=5)]
    calls = Calls(rows)
    keys = np.array([1, 7, 12, 16, 21, 23, 26, 35, 45, 51])
    which, row = calls.innermost(keys)
    stacks = calls.column(which, row, 4, 0).tolist()
    assert stacks == [1, 0, 2, 3, 4, 5, 4, 2, 0, 6]
    assert which.tolist() == [1, 0, 2, 1, 2, 1, 2, 2, 0, 1]


def test_ranges_innermost_and_between_nodes():
    """Nested node ranges: the innermost holds; AccumulateGrad (-1) holds its own memory; between two
    nodes (the engine summing gradients) the node that ran last, but only inside a backward pass."""
    r = Ranges([(100, 200, 7), (120, 150, 8), (300, 400, -1), (500, 600, 9)])
    t = np.array([110, 130, 160, 250, 350, 450, 550, 700, 50])
    assert r.innermost(t).tolist() == [7, 8, 7, -1, -1, -1, 9, -1, -1]
    between = np.ones(len(t), bool)
    between[-2] = False  # after the pass
    assert r.innermost(t, between=between).tolist() == [7, 8, 7, 7, -1, -1, 9, -1, -1]


def test_origin_table_lookup_and_bound():
    table = OriginTable(cap=3)
    rows = [_row(0, 1, stack=11, module=1, s0=10, s1=12, cid=0), _row(1, 2, stack=12, s0=12, s1=12, cid=1),
            _row(2, 3, stack=13, module=2, s0=12, s1=13, cid=2)]
    table.add(Calls(rows))
    stack, module = table.lookup(np.array([9, 10, 11, 12, 13, -1]))
    assert stack.tolist() == [-1, 11, 11, 13, -1, -1] and module.tolist() == [-1, 1, 1, 2, -1, -1]
    table.add(Calls([_row(3, 4, stack=20 + i, s0=20 + i, s1=21 + i, cid=3 + i) for i in range(3)]))
    assert table.lookup(np.array([10, 21]))[0].tolist() == [-1, 21]  # the oldest went


class Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.seen = {}

    def forward(self, x):
        h = self.lin(x)
        self.seen["line"] = sys._getframe().f_lineno + 1
        self.seen["real"] = traceback.extract_stack(sys._getframe()); y = (h * 3).softmax(-1)  # noqa: E702
        return y


def _visible(stack):
    import re

    return [(f.filename, f.lineno, f.name) for f in reversed(stack)
            if not re.search(r"tracekit[/\\]record[/\\]", f.filename) and f.name != "handle_torch_function"]


def test_oplog_stack_is_the_real_one_through_module_anchors():
    """A call inside nested modules is logged with the real stack, frame by frame, though the walk stops
    at the running module's frame and reuses the stack interned when the module began."""
    from tracekit.record.oplog import OpLog

    model = torch.nn.Sequential(torch.nn.Sequential(Inner()))
    log = OpLog(roots=lambda: [("", model)])
    log.install(timed=True)
    try:
        model(torch.ones(2, 4))
    finally:
        log.remove()
    inner = model[0][0]
    rows = log.take_rows()
    softmax = [r for r in rows if log.stacks.frames(r[4]) and log.stacks.frames(r[4])[0]["line"] == inner.seen["line"]]
    assert softmax, [log.stacks.frames(r[4])[:1] for r in rows]
    got = [(f["filename"], f["line"], f["name"]) for f in log.stacks.frames(softmax[-1][4])]
    assert got == _visible(inner.seen["real"])
    assert log.path_names[softmax[-1][5]] == "0.0"  # the module that ran it
    assert log._mods == [(0, None, 0, 0)] and not log._handles  # nothing left


def test_oplog_module_paths_and_lines_never_zero():
    from tracekit.record.oplog import OpLog

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU()))
    extra = torch.nn.Tanh()  # not under a known root: named under the running module
    log = OpLog(roots=lambda: [("", model)])
    log.install(timed=True)
    try:
        y = model(torch.zeros(1, 2))
        z = extra(y)  # noqa: F841
    finally:
        log.remove()
    names = {log.path_names[r[5]] for r in log.take_rows()}
    assert {"0", "1.0", "Tanh"} <= names
    for k in range(1, len(log.stacks)):
        assert all(f["line"] > 0 for f in log.stacks.frames(k))


def test_cuda_annotate_names_calls_and_backward_nodes():
    """The CUDA join on a synthetic history: entries naming their call by metadata (:op=ID, taken off
    again), entries of autograd's thread inside a backward node's range (forward origin of the node's
    call, frames of the backward call), live blocks given their allocation's frames."""
    from tracekit.record.cuda import annotate
    from tracekit.record.oplog import CallMetadata, OpLog

    stamped = []
    md = CallMetadata(stamped.append)
    md.active = True
    md.set_base("tracekit:iter=0:phase=forward")
    model = torch.nn.Linear(4, 4)
    log = OpLog(roots=lambda: [("", model)], metadata=md)
    log.install(timed=True)
    try:
        x = torch.ones(2, 4, requires_grad=True)
        y = model(x).softmax(-1)  # the call that makes SoftmaxBackward0
        y.sum().backward()
    finally:
        log.remove()
    rows = log.take_rows()
    assert any(":op=" in m for m in stamped) and stamped[-1] == "tracekit:iter=0:phase=forward"
    calls = Calls(rows, by_time=True)
    table = OriginTable()
    table.add(calls)
    softmax = next(r for r in rows if r[7] > r[6] and log.stacks.frames(r[4])[0]["name"].startswith("test_cuda"))
    backward = next(r for r in rows if r[11])
    node_seq = softmax[6]
    t_node = (backward[2] + backward[3]) // 2
    ranges = np.array([(t_node - 2000, t_node + 2000, node_seq)], np.int64)
    entries = [
        {"action": "alloc", "addr": 1, "size": 8, "time_us": softmax[2] // 1000,
         "user_metadata": f"tracekit:iter=0:phase=forward:op={softmax[9]}", "frames": []},
        {"action": "alloc", "addr": 2, "size": 8, "time_us": t_node // 1000, "user_metadata": "", "frames": []},
        {"action": "free_completed", "addr": 2, "size": 8, "time_us": t_node // 1000, "user_metadata": "",
         "frames": []},
    ]
    snap = {"device_traces": [entries], "segments": [
        {"device": 0, "blocks": [{"address": 1, "state": "active_allocated", "frames": []}]}]}
    annotate(snap, calls.rows, ranges, table, log.stacks, log.path_names)
    here = log.stacks.frames(softmax[4])
    assert entries[0]["user_metadata"] == "tracekit:iter=0:phase=forward" and entries[0]["frames"] == here
    assert entries[1]["forward_frames"] == here  # made by the softmax's backward node
    assert entries[1]["frames"] == log.stacks.frames(backward[4])  # in the y.sum().backward() call
    assert snap["segments"][0]["blocks"][0]["frames"] == here


def test_profiler_session_steps_aside_for_the_users_profiler():
    """While the user's torch.profiler runs, ours stops; theirs gets its events; ours resumes after and
    sees the backward nodes that run later."""
    from torch.profiler import ProfilerActivity, profile

    from tracekit.record.ranges import ProfilerSession

    model = torch.nn.Linear(4, 4)
    session = ProfilerSession(memory=False, chunk_seconds=0.0, hook_allocations=True)
    session.start()
    try:
        with pytest.warns(RuntimeWarning, match="your torch.profiler started"):
            with profile(activities=[ProfilerActivity.CPU]) as theirs:
                model(torch.ones(2, 4)).sum().backward()
        assert any(e.name == "aten::addmm" for e in theirs.events())
        assert session._on  # ours runs again
        before = len(session.ranges)  # theirs' backward ranges, taken when it stopped
        assert before > 0
        model(torch.ones(2, 4)).sum().backward()
    finally:
        session.stop()
    assert not session._on and session._watch is None
    assert len(session.ranges) > before and session.gaps and session.gaps[0]["filled"] is True


def test_group_peaks_against_a_replay():
    rng = np.random.default_rng(0)
    n = 300
    born = rng.integers(0, 1000, n)
    life = rng.integers(1, 200, n)
    dies = np.where(rng.random(n) < 0.1, -1, born + life)
    born[rng.random(n) < 0.1] = -1  # made before the trace: live from its start
    al = SimpleNamespace(size=rng.integers(1, 1 << 20, n), alloc_index=born, free_index=dies)
    group = rng.integers(-1, 5, n)
    got = group_peaks(group, al, 5)
    for g in range(5):
        live = [int(al.size[(group == g) & (born <= t) & ((dies > t) | (dies < 0))].sum()) for t in range(1300)]
        assert got[g] == max(live)


def test_layers_fold_repeated_modules():
    rows = [{"module": f"model.layers.{i}.mlp", "pass": "forward", "bytes_at_peak": 10 + i, "peak_bytes": 20}
            for i in range(3)] + [{"module": "lm_head", "pass": "backward", "bytes_at_peak": 5, "peak_bytes": 9}]
    (g,) = _layers(rows)
    assert (g["pattern"], g["layers"], g["bytes_at_peak_min"], g["bytes_at_peak_max"],
            g["bytes_at_peak_total"]) == ("model.layers.*.mlp", 3, 10, 12, 33)


def test_module_lines_text():
    from tracekit.render.modules import module_lines

    rows = [{"module": f"layers.{i}.mlp", "pass": "forward", "bytes_at_peak": 1 << 20, "peak_bytes": 2 << 20}
            for i in range(2)]
    table = {"rows": rows, "modules": 2, "layers": _layers(rows)}
    text = "\n".join(module_lines(table))
    assert "1.0 MiB     2.0 MiB  layers.0.mlp (forward)" in text
    assert "layers.*.mlp (forward): 2 modules hold 1.0 MiB each at the peak (2.0 MiB in all), at most 2.0 MiB" in text
    assert module_lines(None) == []


def test_compiled_and_python_op_logs_agree():
    """The op log's hot path in C (_cpuhook.Core) and its Python fallback log the same calls: same stacks
    (frame by frame), modules, autograd sequence numbers and backward calls."""
    from tracekit.record.oplog import OpLog

    pytest.importorskip("tracekit.record._cpuhook")

    def logged(fast):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Sequential(Inner()), torch.nn.Linear(4, 2))
        log = OpLog(roots=lambda: [("", model)])
        log.install(timed=True, fast=fast)
        try:
            assert (log._core is not None) is fast
            y = model(torch.ones(3, 4, requires_grad=True))
            (y * 2).sum().backward()
        finally:
            log.remove()
        rows = np.asarray(log.take_rows(), dtype=np.int64).reshape(-1, 12)
        rows = rows[np.argsort(rows[:, 9])]  # by call id
        return [(tuple((f["filename"], f["line"], f["name"]) for f in log.stacks.frames(int(r[4]))),
                 log.path_names[int(r[5])], int(r[7] - r[6]), int(r[11])) for r in rows]

    fast, slow = logged(True), logged(False)
    assert len(fast) == len(slow) > 5
    assert fast == slow
