"""Unit checks of the origins join (record/origins.py, CUDA path with mocked profiler events),
the module tracker (record/modules.py) and the per-module table (analysis/modules.py)."""
from types import SimpleNamespace

import numpy as np
import torch

from tracekit.analysis.modules import _layers, group_peaks
from tracekit.record.modules import ModuleTracker
from tracekit.record.origins import BACKWARD_RANGE, Origins


def _frame(file, line, name):
    return SimpleNamespace(file_name=file, line_number=line, function_name=name)


def _node(tag, name="", start=0, end=0, children=(), **extra):
    return SimpleNamespace(tag=tag, name=name, start_time_ns=start, end_time_ns=end, children=list(children),
                           extra_fields=SimpleNamespace(**extra))


def _tree():
    """A mocked profiler tree as the CUDA path sees it (no memory events): a forward op called from
    train.py:13 with sequence number 7, and its backward range SoftmaxBackward0 later."""
    from torch._C._profiler import _EventType as E

    op = _node(E.TorchOp, "aten::softmax", 1_000, 2_000, sequence_number=7)
    call = _node(E.PyCCall, "softmax", 900, 2_100, [op], caller=_frame("train.py", 13, "loss_fn"))
    fn = _node(E.PyCall, "loss_fn", 800, 2_200, [call], caller=_frame("train.py", 20, "<module>"),
               callsite=_frame("train.py", 11, "loss_fn"))
    inner = _node(E.TorchOp, "SoftmaxBackward0", 10_500, 19_000, sequence_number=7)
    bwd = _node(E.TorchOp, BACKWARD_RANGE + "SoftmaxBackward0", 10_000, 20_000, [inner], sequence_number=7)
    other = _node(E.TorchOp, BACKWARD_RANGE + "MulBackward0", 30_000, 40_000, sequence_number=99)
    return SimpleNamespace(experimental_event_tree=lambda: [fn, bwd, other])


def test_cuda_join_by_time():
    tracker = ModuleTracker()
    tracker.times, tracker.paths = [500, 2_500], ["lm_head", ""]
    o = Origins(tracker)
    o.take(_tree())
    assert o.forward[7][1] == "lm_head"
    entries = [
        {"action": "alloc", "addr": 1, "size": 8, "time_us": 15, "frames": []},  # inside SoftmaxBackward0
        {"action": "alloc", "addr": 2, "size": 8, "time_us": 25, "frames": []},  # between ranges
        {"action": "alloc", "addr": 3, "size": 8, "time_us": 35, "frames": []},  # range of an unseen forward op
        {"action": "free_completed", "addr": 1, "size": 8, "time_us": 16, "frames": []},
    ]
    snap = {"device_traces": [entries]}
    o.annotate(snap, by_time=True)
    assert entries[0]["forward_frames"][0] == {"filename": "train.py", "line": 13, "name": "loss_fn"}
    assert entries[0]["module"] == "lm_head"
    assert [("forward_frames" in e, "module" in e) for e in entries[1:]] == [(False, False)] * 3
    # a forward allocation (no backward range) takes the module running at its time
    fwd = {"action": "alloc", "addr": 4, "size": 8, "time_us": 1, "frames": []}
    o.annotate({"device_traces": [[fwd]]}, by_time=True)
    assert fwd.get("module") == "lm_head" and "forward_frames" not in fwd
    # the CPU path never joins by time: only what the tree placed
    entries[0].pop("forward_frames")
    entries[0].pop("module")
    o.annotate(snap, by_time=False)
    assert "forward_frames" not in entries[0]


def test_cuda_stackless_profiler_takes_the_allocators_stack():
    """CUDA's profiler records ops without Python stacks (cheaper): a forward op's stack is that of the first
    allocation the allocator recorded inside it; an op that allocated nothing gives no stack, never a guess."""
    from torch._C._profiler import _EventType as E

    op = _node(E.TorchOp, "aten::softmax", 1_000, 2_000, sequence_number=7)
    view = _node(E.TorchOp, "aten::transpose", 3_000, 3_500, sequence_number=8)
    bwd = _node(E.TorchOp, BACKWARD_RANGE + "SoftmaxBackward0", 10_000, 20_000, sequence_number=7)
    bwd_view = _node(E.TorchOp, BACKWARD_RANGE + "TransposeBackward0", 21_000, 22_000, sequence_number=8)
    o = Origins()
    o.take(SimpleNamespace(experimental_event_tree=lambda: [op, view, bwd, bwd_view]))
    line13 = [{"filename": "train.py", "line": 13, "name": "loss_fn"}]
    entries = [
        {"action": "alloc", "addr": 9, "size": 8, "time_us": 0, "frames": [{"filename": "t.py", "line": 1}]},
        {"action": "alloc", "addr": 1, "size": 8, "time_us": 1, "frames": line13},  # made by the softmax
        {"action": "alloc", "addr": 2, "size": 8, "time_us": 15, "frames": []},  # its backward
        {"action": "alloc", "addr": 3, "size": 8, "time_us": 21, "frames": []},  # backward of the view
    ]
    o.annotate({"device_traces": [entries]}, by_time=True)
    assert entries[2]["forward_frames"] == line13
    assert "forward_frames" not in entries[3]


def test_module_tracker_paths():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU()))
    tracker = ModuleTracker(lambda: [("", model)])
    tracker.install()
    try:
        model(torch.zeros(1, 2))
    finally:
        tracker.remove()
    assert tracker.paths == ["Sequential", "0", "Sequential", "1", "1.0", "1", "Sequential", ""]
    assert tracker.times == sorted(tracker.times)
    assert tracker.path_at(tracker.times[4]) == "1.0" and tracker.path_at(tracker.times[0] - 1) == ""


def test_group_peaks_against_a_replay():
    rng = np.random.default_rng(0)
    n = 300
    born = rng.integers(0, 1000, n)
    life = rng.integers(1, 200, n)
    dies = np.where(rng.random(n) < 0.1, -1, born + life)
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


class _Probe(torch.autograd.Function):
    """Notes the trace clock while its backward runs (inside its evaluate_function range)."""

    times = []
    forward_times = []

    @staticmethod
    def forward(ctx, x):
        from tracekit.record.marks import now_us

        _Probe.forward_times.append(now_us())
        return x * 2

    @staticmethod
    def backward(ctx, g):
        from tracekit.record.marks import now_us

        _Probe.times.append(now_us())
        return g * 2


def test_cuda_path_with_a_real_restricted_profiler():
    """The CUDA wiring (Attached with a CUDA backend) on this machine's CPU: the restricted profiler
    sees the forward op and its backward range; an allocator entry stamped inside the backward range gets
    the stack the allocator recorded for the forward op's own allocation."""
    from tracekit.record.origins import Attached

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    rec = SimpleNamespace(_models=[("", model)], max_entries=None, origins=True)
    att = Attached(rec, SimpleNamespace(name="cuda"))
    _Probe.times.clear()
    _Probe.forward_times.clear()
    y = _Probe.apply(model(torch.ones(2, 4)))
    y.sum().backward()
    (t,), (t_forward,) = _Probe.times, _Probe.forward_times
    stack = [{"filename": "train.py", "line": 7, "name": "step"}]
    entries = [{"action": "alloc", "addr": 8, "size": 4, "time_us": t_forward, "frames": stack},
               {"action": "alloc", "addr": 16, "size": 4, "time_us": t, "frames": []}]
    att.finish({"device_traces": [entries]})
    assert entries[1]["forward_frames"] == stack
    assert att.profiler._prof is None and not att.modules._handles  # stopped and unhooked


def test_cuda_profiler_steps_aside_for_the_users_profiler():
    """While the user's torch.profiler runs, ours stops; theirs gets its events; ours resumes after."""
    from torch.profiler import ProfilerActivity, profile

    from tracekit.record.origins import Attached

    model = torch.nn.Linear(4, 4)
    att = Attached(SimpleNamespace(_models=[("", model)], max_entries=None, origins=True), SimpleNamespace(name="cuda"))
    try:
        with profile(activities=[ProfilerActivity.CPU]) as theirs:
            model(torch.ones(2, 4)).sum().backward()
        assert any(e.name == "aten::addmm" for e in theirs.events())
        assert att.profiler._prof is not None  # ours runs again
        before = len(att.origins.ranges)  # theirs' backward ranges, taken when it stopped
        assert before > 0
        _Probe.times.clear()
        _Probe.apply(model(torch.ones(2, 4))).sum().backward()
    finally:
        att.finish({"device_traces": []})
    assert att.profiler._prof is None and att.profiler._watch is None
    assert any(r for r in att.origins.ranges[before:])  # ours saw the backward after theirs stopped


def test_module_lines_text():
    from tracekit.render.modules import module_lines

    rows = [{"module": f"layers.{i}.mlp", "pass": "forward", "bytes_at_peak": 1 << 20, "peak_bytes": 2 << 20}
            for i in range(2)]
    table = {"rows": rows, "modules": 2, "layers": _layers(rows)}
    text = "\n".join(module_lines(table))
    assert "1.0 MiB     2.0 MiB  layers.0.mlp (forward)" in text
    assert "layers.*.mlp (forward): 2 modules hold 1.0 MiB each at the peak (2.0 MiB in all), at most 2.0 MiB" in text
    assert module_lines(None) == []
