"""Our torch.profiler, restricted to what the recorder needs from it.

- The ranges in which autograd's engine runs each backward node, with the node's sequence number
  (RecordScope.BACKWARD_FUNCTION only: forward ops, Python calls, shapes and stacks are not recorded,
  so the profiler costs next to nothing). An allocation made inside such a range was caused by the
  forward call that made that node (origins.py).
- Optionally (the CPU backend without its allocation hook, allochook.py) the CPU allocator's memory
  events, each with the backward node it was made in.

The session is stopped and started again at safe points (`restart`: at phase boundaries, never inside
an open ``record_function`` range, which torch 2.13 does not survive) so that its buffers stay small.
One profiler runs per process: when the user's own starts, ours stops (keeping what it had) and stands
aside; when theirs stops, what it saw is taken (its backward ranges, and with ``profile_memory=True``
its memory events) and ours starts again. Each pause is a gap (`gaps`).
"""
from __future__ import annotations

import time
import warnings

from .entries import quiet_stderr
from .marks import now_us

BACKWARD_RANGE = "autograd::engine::evaluate_function: "


class ProfilerSession:
    def __init__(self, memory=False, chunk_seconds=1.0, hook_allocations=False):
        self.memory = memory  # record memory events (the CPU backend's allocation source)
        self.hook_allocations = hook_allocations  # allocations come from the hook: a pause loses none
        self.chunk_seconds = chunk_seconds
        self.ranges = []  # (start_ns, end_ns, sequence number) of backward nodes
        self.allocations = []  # (time_ns, ptr, size, sequence number or -1), when memory
        self.gaps = []
        self.failed = None  # why the session could not run (then: no ranges)
        self._on = False
        self._started_at = 0.0
        self._raw = True  # torch._C._autograd's profiler calls, with scopes; else torch.profiler.profile
        self._prof = None
        self._watch = None
        self._open = None
        self._paused = None

    # -- lifecycle ---------------------------------------------------------
    def start(self):
        from .coexist import OpenRanges, OtherProfilers, profiler_running

        self._watch = OtherProfilers(self._theirs_started, self._theirs_stopped)
        self._watch.install()
        self._open = OpenRanges()
        self._open.install()
        if profiler_running():
            self._pause("your torch.profiler was already running when tracekit began", inside=False)
        else:
            self._start()

    def restart(self, force=False):
        """Take what the session has and start a new one, if it is time (or `force`) and safe. True when
        what happened until now is taken (or, while the user's profiler runs, nothing is to come)."""
        if self._open is not None and len(self._open):
            return False
        if not self._on:
            return True
        if not force and (self.chunk_seconds is None or time.monotonic() - self._started_at < self.chunk_seconds):
            return False
        self._stop()
        self._start()
        return True

    def stop(self):
        try:
            if self._on:
                self._stop()
            if self._paused is not None:
                self._close_gap(now_us(), filled=False)
        finally:
            self.remove()

    def remove(self):
        """Stop without taking anything (an error path) and stop watching for the user's profiler."""
        if self._on:
            self._on = False
            try:
                with quiet_stderr():
                    self._disable()
            except Exception:
                pass
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        if self._open is not None:
            self._open.remove()
            self._open = None

    def take(self):
        """(ranges, allocations) collected since the last take."""
        ranges, self.ranges = self.ranges, []
        allocations, self.allocations = self.allocations, []
        return ranges, allocations

    # -- one session -------------------------------------------------------
    def _start(self):
        with quiet_stderr():
            self._enable()
        self._on = True
        self._started_at = time.monotonic()

    def _stop(self):
        self._on = False
        with quiet_stderr():
            results = self._disable()
        if results is not None:
            self._walk(results, ours=True)

    def _enable(self):
        import torch
        from torch._C._profiler import ProfilerActivity

        activities = {ProfilerActivity.CPU}
        if self._raw:
            try:
                from torch._C._profiler import (ProfilerConfig, ProfilerState, RecordScope,
                                                _ExperimentalConfig)

                config = ProfilerConfig(ProfilerState.KINETO, False, self.memory, False, False, False,
                                        _ExperimentalConfig())
                autograd = torch._C._autograd
                autograd._prepare_profiler(config, activities)
                autograd._enable_profiler(config, activities, {RecordScope.BACKWARD_FUNCTION})
                return
            except Exception:
                self._raw = False  # an older torch: the public profiler (all ops: slower, same data)
        from torch.profiler import profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=self.memory)
        with self._watch.ours():
            self._prof.start()

    def _disable(self):
        if self._raw:
            import torch

            return torch._C._autograd._disable_profiler()
        prof, self._prof = self._prof, None
        if prof is None:
            return None
        with self._watch.ours():
            prof.stop()
        results = prof.profiler.kineto_results
        prof.profiler = None  # the profile object sits in a reference cycle: let its results go now
        return results

    def _walk(self, results, ours):
        """Backward ranges (and memory events) of one profiler result; any failure drops them, with a warning."""
        try:
            walk(results, self.ranges, self.allocations if self.memory else None, ours)
        except Exception as e:
            if self.failed is None:
                self.failed = repr(e)
                warnings.warn(f"tracekit: could not read the profiler's events ({e!r}); backward allocations "
                              "keep no forward line", RuntimeWarning)

    # -- the user's own profiler ------------------------------------------
    def _theirs_started(self):
        if self._paused is None:
            if self._on:
                self._stop()
            self._pause("your torch.profiler started while tracekit was recording", inside=True)

    def _theirs_stopped(self, results):
        if self._paused is None:
            return
        before = len(self.allocations)
        try:
            self._walk(results, ours=False)
        except Exception:
            pass
        if not self._paused["inside"]:  # theirs began before us: only what came after we began
            start_ns = self._paused["start_us"] * 1000
            self.ranges = [r for r in self.ranges if r[1] >= start_ns]
            self.allocations = [a for a in self.allocations if a[0] >= start_ns]
        filled = self.hook_allocations or len(self.allocations) > before
        self._close_gap(now_us(), filled)
        self._start()

    def _pause(self, reason, inside):
        self._paused = {"start_us": now_us(), "end_us": None, "reason": reason, "filled": False, "inside": inside}
        what = ("CPU allocations are still recorded; backward allocations made meanwhile keep no forward line"
                if self.hook_allocations else "with profile_memory=True, its memory events fill the pause")
        warnings.warn(f"tracekit: {reason}; one profiler runs at a time, so tracekit's stands aside until yours "
                      f"stops ({what}); the pause is in the file's gaps", RuntimeWarning, stacklevel=4)

    def _close_gap(self, end_us, filled):
        gap, self._paused = self._paused, None
        gap["end_us"] = end_us
        gap["filled"] = bool(filled)
        del gap["inside"]
        self.gaps.append(gap)


def walk(results, ranges, allocations, ours):
    """Append the backward ranges (start_ns, end_ns, seq) of a profiler result to `ranges` and, when
    `allocations` is a list, its CPU memory events (time_ns, ptr, size, seq of the enclosing backward
    node or -1). `ours`: a result of our restricted session, where every op is a backward node."""
    from torch._C._profiler import _EventType

    ALLOC, OP = _EventType.Allocation, _EventType.TorchOp
    todo = [(root, -1) for root in reversed(results.experimental_event_tree())]
    pop, push = todo.pop, todo.append
    while todo:
        node, seq = pop()
        tag = node.tag
        if tag == ALLOC:
            if allocations is not None:
                ef = node.extra_fields
                size = ef.alloc_size
                if size and ef.ptr and ef.device.type == "cpu":
                    allocations.append((node.start_time_ns, ef.ptr, size, seq))
            continue
        if tag == OP and (ours or node.name.startswith(BACKWARD_RANGE)):
            # every backward node, AccumulateGrad (no number: -1) too, so that its memory is nobody else's
            seq = node.extra_fields.sequence_number
            ranges.append((node.start_time_ns, node.end_time_ns, seq))
        children = node.children
        if children:
            for child in reversed(children):
                push((child, seq))
