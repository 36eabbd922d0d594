"""The forward origin of backward allocations, and the module of every allocation.

The profiler stamps each forward op with the autograd sequence number of the
node it makes, and runs each backward node inside a range
``autograd::engine::evaluate_function: SoftmaxBackward0`` carrying the same
number. So an allocation made inside that range was caused by the forward op
with that number: its Python stack (the user's line, e.g. ``big =
logits.float().softmax(-1)``) becomes the entry's ``forward_frames``, and the
module that ran that op (modules.py) its ``module``. Forward allocations get
the module running when they were made.

CPU: the profiler's tree says exactly which allocation sits in which range
(`Origins.take`, keyed by time and address). CUDA: the allocator history and
the profiler are separate, so an allocation is joined to the backward range
whose time span holds it (`Origins.annotate` with ranges); `CudaProfiler`
runs a profiler restricted to what this needs (ops only: no Python stacks, no
memory events, no shapes), and a forward op's stack is that of the first
allocation the allocator recorded inside it.

Set TRACEKIT_ORIGINS=0 (or ``record(..., origins=False)``) to record without it.
"""
from __future__ import annotations

import bisect
import os

from .entries import _frames_key, frame_list

BACKWARD_RANGE = "autograd::engine::evaluate_function: "
MAX_FORWARD = 1 << 20  # forward ops remembered (their backward may come in a later profiler session)


def enabled(default=True) -> bool:
    v = os.environ.get("TRACEKIT_ORIGINS")
    return default if v is None else v.strip().lower() not in ("0", "false", "no", "off", "")


class Origins:
    """Collects, session by session, what each allocation's origin is; writes it into the snapshot."""

    def __init__(self, modules=None, max_entries=None):
        self.modules = modules  # ModuleTracker or None
        self.max_allocs = max_entries or (1 << 22)
        self.forward = {}  # sequence number -> (frames key, module path) of the forward op that made the node
        self.by_alloc = {}  # (time_us, addr) -> (forward frames key or None, module path)
        self.ranges = []  # (start_ns, end_ns, sequence number): backward ranges, for joining by time
        self.spans = {}  # sequence number -> (start_ns, end_ns) of its forward op (CUDA: stacks come from the allocator)

    def take(self, results):
        """Walk one profiler session's event tree (a kineto result)."""
        from torch._C._profiler import _EventType

        py_tags = (_EventType.PyCall, _EventType.PyCCall)
        torch_op, allocation = _EventType.TorchOp, _EventType.Allocation
        path_at = self.modules.path_at if self.modules is not None else (lambda t: "")
        forward, by_alloc, spans = self.forward, self.by_alloc, self.spans
        todo = [(root, (), None) for root in reversed(results.experimental_event_tree())]
        last_ns = 0
        while todo:
            node, pyframes, seq = todo.pop()
            tag = node.tag
            if tag in py_tags:
                pyframes = pyframes + ((node, tag),)
            elif tag == torch_op:
                n = node.extra_fields.sequence_number
                if seq is None and node.name.startswith(BACKWARD_RANGE):
                    seq = n
                    self.ranges.append((node.start_time_ns, node.end_time_ns, n))
                elif seq is None and n >= 0:  # the last op with a number is the one that made its node
                    forward[n] = (_frames_key(pyframes, (), _EventType.PyCall) if pyframes else None,
                                  path_at(node.start_time_ns))
                    spans[n] = (node.start_time_ns, node.end_time_ns)
            elif tag == allocation:
                ef = node.extra_fields
                t = node.start_time_ns
                last_ns = max(last_ns, t)
                if ef.alloc_size > 0 and ef.ptr:
                    if seq is None:
                        module = path_at(t)
                        if module:
                            by_alloc[(t // 1000, ef.ptr)] = (None, module)
                    else:
                        origin = forward.get(seq)
                        if origin is not None:
                            by_alloc[(t // 1000, ef.ptr)] = origin
            for child in reversed(node.children):
                todo.append((child, pyframes, seq))
        self._trim(last_ns)

    def _trim(self, last_ns):
        if self.modules is not None and last_ns:
            self.modules.forget_before(last_ns)
        for d, cap in ((self.by_alloc, self.max_allocs), (self.forward, MAX_FORWARD), (self.spans, MAX_FORWARD)):
            if len(d) > cap:
                for k in list(d)[:len(d) - cap]:
                    del d[k]
        if len(self.ranges) > MAX_FORWARD:
            del self.ranges[:len(self.ranges) - MAX_FORWARD]

    def annotate(self, snapshot, by_time=False):
        """Add ``forward_frames`` and ``module`` to the snapshot's alloc entries (and their segment_alloc).

        `by_time`: entries not seen in the profiler's tree (CUDA) are joined
        to the innermost backward range holding their time.
        """
        lists = {}

        def frames_of(key):
            f = lists.get(key)
            if f is None:
                f = lists[key] = frame_list(key)
            return f

        ranges = sorted(self.ranges) if by_time else []
        starts = [r[0] for r in ranges]
        for entries in snapshot.get("device_traces") or []:
            stacked = _StackedAllocations(entries) if by_time else None
            for e in entries:
                if e.get("action") not in ("alloc", "segment_alloc"):
                    continue
                origin = self.by_alloc.get((e.get("time_us"), e.get("addr")))
                seq = None
                if origin is None and by_time and e.get("action") == "alloc" and e.get("time_us") is not None:
                    t_ns = e["time_us"] * 1000
                    seq = self._by_time(t_ns, ranges, starts) if ranges else None
                    origin = self.forward.get(seq) if seq is not None else None
                    if origin is None and self.modules is not None:  # a forward allocation: its module
                        module = self.modules.path_at(t_ns)
                        origin = (None, module) if module else None
                if origin is None:
                    continue
                key, module = origin
                if key:
                    e["forward_frames"] = frames_of(key)
                elif seq is not None and seq in self.spans:  # a profiler without stacks (CUDA)
                    frames = stacked.within(*self.spans[seq])
                    if frames:
                        e["forward_frames"] = frames
                if module:
                    e["module"] = module

    def _by_time(self, t_ns, ranges, starts):
        """The sequence number of the innermost backward range holding t_ns (ranges sorted by start)."""
        i = bisect.bisect_right(starts, t_ns) - 1
        # ranges nest: walk back to the latest-starting one that still holds t_ns
        for j in range(i, max(i - 64, -1), -1):
            s, end, seq = ranges[j]
            if s <= t_ns <= end + 999:  # entries are stamped in whole µs
                return seq
        return None


class _StackedAllocations:
    """The allocator's own Python stacks, by time: the stack of a forward op is that of the first
    allocation made inside it (CUDA, where our profiler records ops without stacks: far cheaper)."""

    def __init__(self, entries):
        rows = [(e["time_us"], e["frames"]) for e in entries
                if e.get("action") == "alloc" and e.get("frames") and e.get("time_us") is not None]
        self.times = [t for t, _ in rows]
        self.frames = [f for _, f in rows]

    def within(self, start_ns, end_ns):
        i = bisect.bisect_left(self.times, start_ns // 1000)
        if i < len(self.times) and self.times[i] * 1000 <= end_ns + 999:
            return self.frames[i]
        return None


class CudaProfiler:
    """A profiler restricted to what origins need beside the CUDA allocator history: CPU ops (no Python
    stacks, no memory events, no shapes, no CUDA activity), for the whole recording.

    One profiler runs per process: while the user's own runs (coexist.py), ours is stopped and
    what theirs saw is taken instead; it starts again when theirs stops.
    """

    def __init__(self, origins):
        self.origins = origins
        self._prof = None
        self._watch = None

    def start(self):
        from .coexist import OtherProfilers, profiler_running

        if self._watch is None:
            self._watch = OtherProfilers(self._stop_session, self._theirs_stopped)
            self._watch.install()
        if not profiler_running():
            self._start_session()

    def _start_session(self):
        from torch.profiler import ProfilerActivity, profile

        from .entries import quiet_stderr

        # No stacks: the allocator records each allocation's Python stack already (_StackedAllocations).
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=False, with_stack=False,
                       record_shapes=False)
        with self._watch.ours(), quiet_stderr():
            prof.start()
        self._prof = prof

    def _stop_session(self):
        prof, self._prof = self._prof, None
        if prof is None:
            return
        from .entries import quiet_stderr

        with self._watch.ours(), quiet_stderr():
            prof.stop()
        take(self.origins, prof.profiler.kineto_results)

    def _theirs_stopped(self, results):
        take(self.origins, results)
        self._start_session()

    def stop(self):
        try:
            self._stop_session()
        finally:
            if self._watch is not None:
                self._watch.remove()
                self._watch = None


class Attached:
    """What the recorder holds: the module hooks, the origins, and on CUDA the restricted profiler.

    Every step is guarded: a failure warns once and drops the field, never the recording or the training.
    """

    def __init__(self, recorder, backend):
        from .modules import ModuleTracker

        self.modules = ModuleTracker(lambda: recorder._models)
        self.origins = Origins(self.modules, recorder.max_entries)
        self.backend = backend
        self.profiler = None
        self.failed = False
        self.modules.install()
        if backend.name == "cpu":
            backend.origins = self.origins
        elif backend.name == "cuda":
            self.profiler = CudaProfiler(self.origins)
            self.profiler.start()

    def finish(self, snapshot):
        """Stop the profiler (CUDA) and write the fields into the snapshot."""
        try:
            if self.profiler is not None:
                self.profiler.stop()
            if not self.failed:
                self.origins.annotate(snapshot, by_time=self.profiler is not None)
        except Exception as e:
            self._fail(e)
        finally:
            self.remove()

    def remove(self):
        try:
            self.modules.remove()
            if self.profiler is not None and self.profiler._prof is not None:
                self.profiler.stop()
        except Exception:
            pass
        if getattr(self.backend, "origins", None) is self.origins:
            self.backend.origins = None

    def _fail(self, e):
        import warnings

        if not self.failed:
            self.failed = True
            warnings.warn(f"tracekit: backward allocations keep no forward origin in this recording ({e!r})",
                          RuntimeWarning)


def attach(recorder, backend):
    """Attached origins for this recording, or None when TRACEKIT_ORIGINS=0 / origins=False or it cannot start."""
    if not (getattr(recorder, "origins", True) and enabled()):
        return None
    try:
        return Attached(recorder, backend)
    except Exception as e:
        import warnings

        warnings.warn(f"tracekit: recording without forward origins and modules ({e!r})", RuntimeWarning)
        return None


def take(origins, results):
    """`origins.take(results)` that never raises into the recorder (the field is dropped instead)."""
    try:
        origins.take(results)
    except Exception as e:
        import warnings

        origins.take = lambda r: None
        warnings.warn(f"tracekit: forward origins stopped ({e!r})", RuntimeWarning)
