"""CPU recorder stacks: each allocation's frames are the true call chain, innermost first.

Every path that starts the profiler is covered: `record_steps` (the profiler
starts inside the recorder, with its frames on the stack, after warm-up or
before the first step), the `record` context manager, and an unmodified
script under `tracekit record --`. The allocations are made in known nested
functions, one of them a gradient hook that the autograd engine (a C call)
runs inside `loss.backward()`; each recorded stack must equal the Python
stack captured on the allocating line, frame by frame (file, line, name).
"""
import json
import os
import re
import subprocess
import sys
import textwrap
import traceback

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tracekit  # noqa: E402
import tracekit.record as tk_record  # noqa: E402
from tracekit.model import ALLOC  # noqa: E402

HERE = os.path.basename(__file__)
FORWARD_NUMEL = 1237 * 811  # unique sizes, to find the allocations in the trace
HOOK_NUMEL = 997 * 613


class Step:
    """step_fn -> outer -> inner allocates; backward runs grad_hook -> inner, which allocates too."""

    def __init__(self):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(8, 8)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.real = {}  # numel -> the Python stack on the allocating line, innermost first

    def inner(self, numel):
        self.real[numel] = _here(sys._getframe()); x = torch.ones(numel)  # noqa: E702 (one line: same line number)
        return x.sum()

    def outer(self, numel):
        return self.inner(numel)

    def grad_hook(self, grad):
        self.outer(HOOK_NUMEL)
        return grad

    def step_fn(self):
        y = self.model(torch.randn(4, 8))
        y.register_hook(self.grad_hook)
        loss = y.sum() + self.outer(FORWARD_NUMEL) * 0
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def visible(filename, name):
    """A frame the recording shows: the recorder's own frames (tracekit/record/, but the demo model) and
    torch's dispatch into the recorder's mode (handle_torch_function) are left out."""
    if re.search(r"(^|[/\\])tracekit[/\\]record[/\\](?!toy\.py$)", filename):
        return False
    return not (name == "handle_torch_function" and filename.endswith("overrides.py"))


def _here(frame):
    """(file basename, line, function) from `frame` outwards, innermost first, as the recording shows them."""
    return [(os.path.basename(f.filename), f.lineno, f.name) for f in reversed(traceback.extract_stack(frame))
            if visible(f.filename, f.name)]


def recorded_stacks(path, numel):
    """The distinct stacks, as [(filename, line, name)], of the allocations of `numel` floats."""
    trace = tracekit.load(path, use_cache=False)
    ev = trace.events
    rows = np.flatnonzero((ev.action == ALLOC) & (ev.size == numel * 4))
    assert len(rows), f"no allocation of {numel} floats in {path}"
    stacks = []
    for i in rows:
        frames = [(f["filename"], f["line"], f["name"]) for f in trace.stack(int(ev.stack_id[i]))]
        if frames not in stacks:
            stacks.append(frames)
    return stacks


def short(stack):
    return [(os.path.basename(file), line, name) for file, line, name in stack]


def ours(stack):
    """Function names of the frames in this file, innermost first (the recorder's own never show)."""
    assert all(visible(file, name) for file, _, name in stack), stack
    return [name for file, _, name in stack if os.path.basename(file) == HERE]


def check_stacks(path, real, numel, test_name, expected):
    """The recorded stack is the real one (the profiler may cut it at 128 frames deep at start), and
    its frames in this file and in the recorder read `expected`, down to this test's frame."""
    (stack,) = recorded_stacks(path, numel)
    assert len(stack) >= min(len(real), 120), (short(stack), real)
    assert short(stack) == real[:len(stack)]
    names = ours(stack)
    assert test_name in names, names
    assert names[: names.index(test_name) + 1] == expected + [test_name]


# The frames in this file: the hook runs inside loss.backward() (through the recorder's wrappers, which
# are truly on the stack but never shown).
FORWARD = ["inner", "outer", "step_fn"]
HOOK = ["inner", "outer", "grad_hook", "step_fn"]


@pytest.mark.parametrize("warmup", [0, 1])
def test_record_steps_stacks_are_the_call_chain(tmp_path, warmup):
    s = Step()
    path = tk_record.record_steps(s.step_fn, steps=1, warmup=warmup, path=tmp_path / "s.pickle",
                                  model=s.model, optimizer=s.optimizer, backend="cpu")
    name = "test_record_steps_stacks_are_the_call_chain"
    check_stacks(path, s.real[FORWARD_NUMEL], FORWARD_NUMEL, name, FORWARD)  # record_steps is the recorder's
    check_stacks(path, s.real[HOOK_NUMEL], HOOK_NUMEL, name, HOOK)


def test_context_manager_stacks_are_the_call_chain(tmp_path):
    s = Step()
    path = tmp_path / "c.pickle"
    with tk_record.record(path, model=s.model, optimizer=s.optimizer, backend="cpu") as rec:
        s.step_fn()
        rec.step()
    name = "test_context_manager_stacks_are_the_call_chain"
    check_stacks(path, s.real[FORWARD_NUMEL], FORWARD_NUMEL, name, FORWARD)
    check_stacks(path, s.real[HOOK_NUMEL], HOOK_NUMEL, name, HOOK)


SCRIPT = textwrap.dedent("""
    import json, os, re, sys, traceback
    import torch

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    real = {}  # numel -> the stack in the recorded step

    def inner(numel):
        here = traceback.extract_stack(sys._getframe()); x = torch.ones(numel)
        if n == int(sys.argv[1]):
            real[numel] = [(os.path.basename(f.filename), f.lineno, f.name) for f in reversed(here)
                           if not re.search(r"tracekit/record/", f.filename) and f.filename != "<string>"
                           and f.name != "handle_torch_function"]
        return x.sum()

    def outer(numel):
        return inner(numel)

    def grad_hook(grad):
        outer(%(hook)d)
        return grad

    def step():
        y = model(torch.randn(4, 8))
        y.register_hook(grad_hook)
        loss = y.sum() + outer(%(forward)d) * 0
        loss.backward()
        opt.step()
        opt.zero_grad()

    def main():
        global n
        for n in range(int(sys.argv[1]) + 2):
            step()
        with open("real.json", "w") as f:
            json.dump({str(k): v for k, v in real.items()}, f)

    main()
""") % {"hook": HOOK_NUMEL, "forward": FORWARD_NUMEL}


@pytest.mark.parametrize("warmup", [0, 1])
def test_script_stacks_are_the_call_chain(tmp_path, warmup):
    (tmp_path / "train.py").write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, "-m", "tracekit.cli", "record", "-o", "out.pickle", "--backend", "cpu",
         "--warmup", str(warmup), "--steps", "1", "--", sys.executable, "train.py", str(warmup)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    real = {int(k): [tuple(f) for f in v] for k, v in json.loads((tmp_path / "real.json").read_text()).items()}
    for numel, chain in ((FORWARD_NUMEL, ["inner", "outer", "step", "main", "<module>"]),
                         (HOOK_NUMEL, ["inner", "outer", "grad_hook", "step", "main", "<module>"])):
        (stack,) = recorded_stacks(tmp_path / "out.pickle", numel)
        stack = short(stack)
        assert stack == real[numel], (stack, real[numel])
        assert [name for file, _, name in stack if file == "train.py"] == chain
        # Below the script: nothing (the bootstrap's frames are the recorder's own).
        assert stack[-1] == ("train.py", stack[-1][1], "<module>")
