"""Backward allocations named by the forward line and module that cause them (record/origins.py).

Planted scripts (tests/planted/) are recorded as a user would, with
`tracekit record -- python script.py`; the backward-pass spike must name the
forward line that causes it (its line number in the script) and the module.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

import tracekit
from tracekit.analysis.report import build_report

PLANTED = os.path.join(os.path.dirname(__file__), "planted")


def line_of(script, text):
    with open(os.path.join(PLANTED, script)) as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


def run(args, cwd, env=None):
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def record(script, tmp_path, env=None):
    """(the recording, stdout with recording, stdout without)."""
    path = os.path.join(PLANTED, script)
    plain = run([sys.executable, path], tmp_path)
    rec = run([sys.executable, "-m", "tracekit.cli", "record", "-o", "r.pickle", "--", sys.executable, path],
              tmp_path, env)
    assert plain.returncode == 0 and rec.returncode == 0, rec.stderr
    return tracekit.load(str(tmp_path / "r.pickle")), rec.stdout, plain.stdout


def backward_spike(trace):
    spikes = [f for f in build_report(trace)["findings"] if f["kind"] == "spike" and f["phase"] == "backward"]
    assert spikes
    return max(spikes, key=lambda f: f["bytes"])


def site(spike, script, line):
    return next(s for s in spike["top_stacks"] if s["user_frame"] and s["user_frame"]["line"] == line
                and s["user_frame"]["filename"].endswith(script) and s["forward_origin"])


@pytest.mark.slow
def test_upcast_in_the_loss(tmp_path):
    trace, out, plain = record("upcast_loss.py", tmp_path)
    assert out == plain  # losses and every gradient bit-identical (hex floats)
    spike = backward_spike(trace)
    top = spike["top_stacks"][0]
    line = line_of("upcast_loss.py", "big = logits.float().softmax(-1)")
    assert top["frames"][0]["line"] == line and top["frames"][0]["name"] == "loss_fn"
    assert top["where"] == f"backward of planted/upcast_loss.py:{line} in loss_fn"
    assert top["module"] is None  # the loss runs outside any module
    # SoftmaxBackward's gradient: 512 x 8192 fp32, one per iteration
    assert top["bytes"] == 512 * 8192 * 4 and top["count"] == 1
    assert spike["where"] == top["where"]
    # lm_head's own backward (its input gradient, bf16) is named by its forward call and module
    ev = trace.events
    mod = np.array(trace.strings.items, dtype=object)[ev.module]
    fwd = ev.forward_stack_id >= 0
    assert {"lm_head", "body"} <= set(mod[fwd & (ev.action == 0)].tolist())
    assert (mod[~fwd & (ev.action == 0) & (ev.size == 512 * 8192 * 2)] == "lm_head").any()  # its forward output


@pytest.mark.slow
def test_eager_attention(tmp_path):
    trace, out, plain = record("attention.py", tmp_path)
    assert out == plain
    spike = backward_spike(trace)
    line = line_of("attention.py", "weights = scores.softmax(-1)")
    s = site(spike, "attention.py", line)
    assert s["module"] in ("0.attn", "1.attn")
    assert s["bytes"] == 2 * 1024 * 1024 * 4  # SoftmaxBackward's (batch, seq, seq) fp32 gradient
    # every backward allocation of the spike comes from a forward line of Attention.forward, in its module
    fwd_def = line_of("attention.py", "def forward(self, x):")
    for t in spike["top_stacks"][:2]:
        assert t["forward_origin"] and t["module"].endswith(".attn")
        assert fwd_def <= t["user_frame"]["line"] <= line + 1


@pytest.mark.slow
def test_large_saved_intermediate_and_turning_it_off(tmp_path):
    trace, out, plain = record("saved_intermediate.py", tmp_path)
    assert out == plain
    spike = backward_spike(trace)
    top = spike["top_stacks"][:2]
    gelu = line_of("saved_intermediate.py", "a = torch.nn.functional.gelu(h)")
    assert {(t["user_frame"]["line"], t["module"]) for t in top} == {(gelu, "mlp"), (gelu + 1, "mlp.down")}
    assert all(t["bytes"] == 512 * 8192 * 4 for t in top)
    # per module: the saved wide intermediate is mlp.up's forward output; mlp's backward makes its gradient
    rows = {(r["module"], r["pass"]): r for r in build_report(trace)["devices"][0]["modules"]["rows"]}
    assert rows[("mlp.up", "forward")]["bytes_at_peak"] == 512 * 8192 * 4
    assert rows[("mlp", "backward")]["peak_bytes"] == 512 * 8192 * 4
    off = tmp_path / "off"
    off.mkdir()
    trace, out, _ = record("saved_intermediate.py", off, env={"TRACEKIT_ORIGINS": "0"})
    assert out == plain
    assert (trace.events.forward_stack_id < 0).all() and (trace.events.module == 0).all()
    assert not any(t["forward_origin"] for t in backward_spike(trace)["top_stacks"])
