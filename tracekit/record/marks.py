"""Iterations and phases of a training loop, as marked by the recorder's hooks.

`Marks` is a small state machine fed by hooks (forward started, backward
started/ended, optimizer step started/ended, explicit step boundary). It keeps
the phase and iteration intervals on the trace clock (`now_us`) and tells the
backend the metadata string to attach to new allocations,
e.g. ``tracekit:iter=3:phase=forward``.

Rules:
- forward begins at the model's (outermost module's) forward and lasts until
  backward or the optimizer step begins, so it covers the loss computed
  outside the model;
- backward lasts while ``torch.autograd.backward``/``grad`` runs;
- optimizer lasts while ``optimizer.step()`` runs; a forward and backward run
  by a closure inside it (``optimizer.step(closure)``: Lightning's automatic
  optimization, LBFGS) are forward and backward, the update after them
  optimizer again;
- an iteration ends at an explicit ``rec.step()``; without one, at the first
  forward after an optimizer step (or, while no optimizer is known, the first
  forward after a backward).
"""
from __future__ import annotations

import time

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"
MAX_MARKS = 100_000  # phases (and iterations) kept, the newest: bounded on long runs
PHASES = (FORWARD, BACKWARD, OPTIMIZER)


def now_us() -> int:
    """The trace clock: Unix time in microseconds, as PyTorch stamps trace entries."""
    return time.time_ns() // 1000


def metadata_string(iteration, phase=None) -> str:
    """The user_metadata written on entries: tracekit:iter=N[:phase=P]."""
    s = f"tracekit:iter={iteration}"
    return f"{s}:phase={phase}" if phase else s


class Marks:
    """Phase and iteration intervals; `on_change(metadata)` is called at every transition."""

    def __init__(self, first_iteration=0, on_change=None, clock=now_us):
        self.clock = clock
        self.on_change = on_change
        self.iteration = first_iteration
        self.phase = None
        self.phases = []  # finished phases: dicts
        self.iterations = []  # finished iterations: dicts
        self.explicit_steps = False  # rec.step() was called: only it ends iterations
        self.optimizer_known = False
        self._iteration_start = None
        self._phase_start = None
        self._stepped = False  # an optimizer step finished in this iteration
        self._backward_done = False  # a backward finished in this iteration
        self._backward_depth = 0
        self._optimizer_depth = 0
        self._closure = False  # forward/backward running in a closure inside optimizer.step (Lightning, LBFGS)

    # -- lifecycle ---------------------------------------------------------
    def start(self, t=None):
        self._iteration_start = self.clock() if t is None else t
        self._changed()

    def finish(self, t=None):
        """Close the open phase and iteration (a trailing iteration without phases is dropped)."""
        if self._iteration_start is None:
            return
        t = self.clock() if t is None else t
        self._end_phase(t)
        self._end_iteration(t, keep_empty=not self.iterations)
        self._iteration_start = None

    def forget_before(self, t):
        """Drop the phases and iterations that ended before `t` (the trace keeps nothing of them)."""
        for marks in (self.phases, self.iterations):
            i = 0
            while i < len(marks) and marks[i]["end_us"] < t:
                i += 1
            if i:
                del marks[:i]

    @property
    def started(self):
        return self._iteration_start is not None

    @property
    def metadata(self) -> str:
        return metadata_string(self.iteration, self.phase)

    # -- events from hooks -------------------------------------------------
    def forward_started(self):
        """The outermost module's forward began. Returns True if a new iteration began."""
        if self._optimizer_depth and self.phase == OPTIMIZER and not self._backward_depth:
            self._closure = True  # optimizer.step(closure) runs the forward and backward itself
            self._begin_phase(FORWARD, self.clock())
            return False
        if self._backward_depth or self._optimizer_depth or self.phase == FORWARD:
            return False  # recompute inside backward, or a second model call in the same forward
        t = self.clock()
        new_iteration = False
        if not self.explicit_steps and (
            self._stepped or (self._backward_done and not self.optimizer_known)
        ):
            self._end_iteration(t)
            new_iteration = True
        self._begin_phase(FORWARD, t)
        return new_iteration

    def backward_started(self):
        self._backward_depth += 1
        if self._backward_depth == 1 and (not self._optimizer_depth or self._closure):
            self._begin_phase(BACKWARD, self.clock())

    def backward_ended(self):
        self._backward_depth = max(0, self._backward_depth - 1)
        if self._backward_depth == 0 and self.phase == BACKWARD:
            self._backward_done = True
            if self._closure:  # back in optimizer.step: the update follows
                self._begin_phase(OPTIMIZER, self.clock())
                return
            self._end_phase(self.clock())
            self._changed()

    def optimizer_started(self):
        self.optimizer_known = True
        self._optimizer_depth += 1
        if self._optimizer_depth == 1:
            self._begin_phase(OPTIMIZER, self.clock())

    def optimizer_ended(self):
        self._optimizer_depth = max(0, self._optimizer_depth - 1)
        if self._optimizer_depth == 0 and (self.phase == OPTIMIZER or self._closure):
            self._stepped = True
            self._closure = False
            self._end_phase(self.clock())
            self._changed()

    def step(self):
        """An explicit iteration boundary (rec.step())."""
        self.explicit_steps = True
        t = self.clock()
        self._end_phase(t)
        self._end_iteration(t)
        self._changed()

    # -- internals ---------------------------------------------------------
    def _begin_phase(self, phase, t):
        self._end_phase(t)
        self.phase = phase
        self._phase_start = t
        self._changed()

    def _end_phase(self, t):
        if self.phase is not None:
            self.phases.append(
                {"iteration": self.iteration, "phase": self.phase, "start_us": self._phase_start, "end_us": t}
            )
            if len(self.phases) > MAX_MARKS:
                del self.phases[:MAX_MARKS // 10]
        self.phase = None
        self._phase_start = None

    def _end_iteration(self, t, keep_empty=True):
        self._end_phase(t)
        has_phases = bool(self.phases) and self.phases[-1]["iteration"] == self.iteration
        if keep_empty or has_phases:
            self.iterations.append({"iteration": self.iteration, "start_us": self._iteration_start, "end_us": t})
            if len(self.iterations) > MAX_MARKS:
                del self.iterations[:MAX_MARKS // 10]
        self.iteration += 1
        self._iteration_start = t
        self._stepped = False
        self._backward_done = False

    def _changed(self):
        if self.on_change is not None:
            self.on_change(self.metadata)
