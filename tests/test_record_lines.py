"""Exact executing lines (issue 23, item 4): spikes name the line that runs, wherever it is.

Planted scripts (tests/planted/) are recorded as a user would, `tracekit record -- python script.py`:
a loss computed at module level, an operator expression inside forward, a lambda, a list
comprehension. The largest backward spike's first frame must be the forward line that makes the
tensor, in the module that ran it; a forward spike at module level must name its own line; no user
frame of the file is ever at line 0; the script prints the same bits with and without recording.
"""
import os
import subprocess
import sys

import pytest

import tracekit
from tracekit.analysis.frames import is_user
from tracekit.analysis.report import build_report

PLANTED = os.path.join(os.path.dirname(__file__), "planted")


def line_of(script, text):
    with open(os.path.join(PLANTED, script)) as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


def record(script, tmp_path):
    path = os.path.join(PLANTED, script)
    env = {k: v for k, v in os.environ.items() if k != "TRACEKIT_ORIGINS"}
    plain = subprocess.run([sys.executable, path], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    rec = subprocess.run([sys.executable, "-m", "tracekit.cli", "record", "-o", "r.pickle", "--backend", "cpu", "--",
                          sys.executable, path], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert plain.returncode == 0 and rec.returncode == 0, rec.stderr[-3000:]
    assert rec.stdout == plain.stdout  # losses and every gradient bit-identical (hex floats)
    trace = tracekit.load(str(tmp_path / "r.pickle"), use_cache=False)
    return trace, build_report(trace)


def largest(report, phase):
    spikes = [f for f in report["findings"] if f["kind"] == "spike" and f["phase"] == phase]
    assert spikes, [f["kind"] for f in report["findings"]]
    return max(spikes, key=lambda f: f["bytes"])


def no_line_zero(trace, script):
    """No frame of the script (a user frame) is at line 0, in any stack of the file."""
    for sid in range(len(trace.stacks)):
        for f in trace.stack(sid):
            if f["filename"].endswith(script):
                assert f["line"] > 0, f


@pytest.mark.slow
def test_loss_at_module_level(tmp_path):
    trace, report = record("module_level_loss.py", tmp_path)
    line = line_of("module_level_loss.py", "big = model(x).double().softmax(-1)")
    top = largest(report, "backward")["top_stacks"][0]
    assert top["forward_origin"] and top["frames"][0]["line"] == line and top["frames"][0]["name"] == "<module>"
    assert top["where"] == f"backward of planted/module_level_loss.py:{line} in <module>"
    assert top["module"] is None  # outside any module
    # a forward-pass spike at module level names its line
    fwd = largest(report, "forward")["top_stacks"][0]
    assert fwd["frames"][0]["line"] == line_of("module_level_loss.py", "spread = (big * big.log1p())")
    assert fwd["frames"][0]["name"] == "<module>" and is_user(fwd["frames"][0])
    no_line_zero(trace, "module_level_loss.py")


@pytest.mark.slow
def test_operator_expression_in_forward(tmp_path):
    trace, report = record("operator_expression.py", tmp_path)
    line = line_of("operator_expression.py", "w = (q @ k.transpose(-2, -1) / d ** 0.5).softmax(-1)")
    assert line != line_of("operator_expression.py", "def forward(self, x):")
    top = largest(report, "backward")["top_stacks"][0]
    assert top["forward_origin"] and top["frames"][0]["line"] == line and top["frames"][0]["name"] == "forward"
    assert top["module"] in ("0", "1")
    assert top["bytes"] >= 2 * 1024 * 1024 * 4  # a (batch, seq, seq) fp32 gradient
    no_line_zero(trace, "operator_expression.py")


@pytest.mark.slow
def test_lambda(tmp_path):
    trace, report = record("lambda_activation.py", tmp_path)
    line = line_of("lambda_activation.py", "self.mix = lambda t:")
    top = largest(report, "backward")["top_stacks"][0]
    assert top["forward_origin"] and top["frames"][0]["line"] == line and top["frames"][0]["name"] == "<lambda>"
    assert top["module"] in ("0", "1")  # the Mixer whose forward called the lambda
    fwd = largest(report, "forward")["top_stacks"][0]
    assert fwd["frames"][0]["line"] == line
    no_line_zero(trace, "lambda_activation.py")


@pytest.mark.slow
def test_comprehension(tmp_path):
    trace, report = record("comprehension.py", tmp_path)
    line = line_of("comprehension.py", "heads = [(a @ b.transpose(-2, -1)).softmax(-1) @ c")
    top = largest(report, "backward")["top_stacks"][0]
    assert top["forward_origin"] and top["frames"][0]["line"] == line
    assert top["frames"][0]["name"] in ("<listcomp>", "forward")  # Python 3.12 inlines comprehensions
    assert top["module"] in ("0", "1")
    no_line_zero(trace, "comprehension.py")


def test_a_frame_at_line_zero_is_never_the_users_line():
    """Older recordings (and other tools) may hold Python frames at line 0 (a line nobody knew): never shown
    as the line to edit; the next real line of the user's is."""
    from tracekit.analysis.frames import USER, frame_kind, is_user, user_first, where

    assert frame_kind("/home/me/train.py", "<module>", 0) != USER
    assert frame_kind("/home/me/train.py", "<module>", 12) == USER
    frames = [{"filename": "/home/me/train.py", "line": 0, "name": "<module>"},
              {"filename": "/home/me/train.py", "line": 31, "name": "main"}]
    assert not is_user(frames[0])
    assert where(user_first(frames)) == "me/train.py:31 in main"  # the user's frames first, as sites show them


def test_a_folder_called_tracekit_holds_the_users_code():
    """tracekit's own frames are its modules (tracekit/record/..., tracekit/cli.py), not any path with a folder of
    that name: a checkout of this repository (its tests), or a user's project called tracekit, is the user's code;
    the demo's model (tracekit/record/toy.py) plays the user's code."""
    from tracekit.analysis.frames import USER, frame_kind

    for user in ("/tmp/ci/tracekit/tests/test_findings.py", "/home/me/tracekit/train.py",
                 r"C:\work\tracekit\tests\t.py", "/x/tracekit/record/toy.py"):
        assert frame_kind(user, "f", 3) == USER, user
    for ours in ("/tmp/ci/tracekit/tracekit/record/recorder.py", "/x/site-packages/tracekit/analysis/report.py",
                 r"C:\x\tracekit\simulate\engine.py", "/x/tracekit/cli.py", "/x/tracekit/__main__.py"):
        assert frame_kind(ours, "f", 3) != USER, ours
