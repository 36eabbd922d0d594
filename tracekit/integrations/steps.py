"""What the Trainer and Lightning callbacks share: record chosen training steps, then say one line about them."""
from __future__ import annotations

import warnings

from ..record.recorder import DEFAULT_MAX_ENTRIES


class StepRecorder:
    """Records `steps` training steps after `warmup_steps`, the framework calling `begin`, `step` and `end`.

    The path may hold "{rank}" / "{pid}"; under a multi-process launch
    without "{rank}" each process adds ".rankN" before the suffix. Never
    raises into training: problems become warnings.
    """

    def __init__(self, path="tracekit-{rank}.pickle", warmup_steps=1, steps=3, backend="auto", stacks="python",
                 max_entries=DEFAULT_MAX_ENTRIES, activations=True, log=print):
        if steps is not None and steps < 1 or warmup_steps < 0:
            raise ValueError("TracekitCallback needs steps >= 1 (or None: until training ends) and warmup_steps >= 0")
        self.path, self.warmup_steps, self.steps = path, warmup_steps, steps
        self.options = dict(backend=backend, stacks=stacks, max_entries=max_entries, activations=activations)
        self.log = log
        self.recorder = None
        self.written = None  # the path written, once it is
        self.summary = None  # the one-line summary, once written

    def begin(self, model=None, optimizer=None, command=None):
        if self.recorder is not None:
            return
        from ..record.recorder import Recorder

        try:
            self.recorder = Recorder(self.path, model, _unwrap(optimizer), warmup=self.warmup_steps, steps=self.steps,
                                     command=command, **self.options)
            self.recorder.start()
        except Exception as e:  # never stop training for the recorder
            warnings.warn(f"tracekit: recording could not start ({e!r})", RuntimeWarning)
            self.recorder = None

    def forward_started(self, module):
        """The framework is about to run the model (for frameworks that call it other than by its forward)."""
        if self.recorder is not None and self.recorder.enabled:
            try:
                self.recorder.forward_started(module, (), {})
            except Exception as e:
                warnings.warn(f"tracekit: could not mark the forward pass ({e!r})", RuntimeWarning)

    def step(self):
        """A training step (optimizer step) ended."""
        if self.recorder is not None and self.written is None:
            self.recorder.step()
            self._check_written()

    def end(self, error=None):
        """Training ended: write what was recorded (if not yet written) and remove every hook."""
        if self.recorder is not None:
            if error is not None and self.recorder.error is None and self.written is None:
                self.recorder.error = f"{type(error).__name__}: {error}"
            self.recorder.close()
            self._check_written()

    def _check_written(self):
        if self.recorder.written and self.written is None:
            self.written = self.recorder.written
            try:
                self.summary = summary_line(self.written)
            except Exception as e:
                self.summary = f"tracekit: wrote {self.written} (no summary: {e!r})"
            if self.log:
                self.log(self.summary)


def summary_line(path) -> str:
    """`tracekit: PATH: 3 steps, peak 1.2 GiB on cuda:0 (activation 55%, parameter 20%, ...); findings: ...`."""
    from ..analysis.report import build_report, shares
    from ..units import fmt_bytes
    from ..io import load

    trace = load(path, use_cache=False)
    report = build_report(trace)
    parts = []
    for d in report["devices"]:
        cats = shares(d.get("categories_at_peak") or {})
        parts.append(f"peak {fmt_bytes(d['peak_allocated_bytes'])} on {d['label']}" + (f" ({cats})" if cats else ""))
    kinds = [f["kind"] for f in report["findings"] if f["kind"] not in ("peak", "advice")]
    found = ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds)) or "no spikes, leaks or OOM"
    n = len((trace.recorder or {}).get("iterations") or [])
    return f"tracekit: {path}: {n} step{'s' if n != 1 else ''}, {'; '.join(parts)}; {found}"


def _unwrap(optimizer):
    """The torch optimizer inside framework wrappers (accelerate's AcceleratedOptimizer, LightningOptimizer)."""
    seen = 0
    while optimizer is not None and seen < 4 and type(optimizer).__name__ in (
            "AcceleratedOptimizer", "LightningOptimizer") and getattr(optimizer, "optimizer", None) is not None:
        optimizer = optimizer.optimizer
        seen += 1
    return optimizer
