"""Recording never weakens autograd: in-place checks still fire, gradients are bit-identical,
torch.func, checkpointing, save_on_cpu and torch.compile run as without us."""
import subprocess
import sys
import textwrap
import warnings

import pytest

torch = pytest.importorskip("torch")

import tracekit  # noqa: E402

INPLACE = textwrap.dedent("""
    import torch
    x = torch.tensor([0.3, -1.2, 2.0], requires_grad=True)
    y = x.sigmoid()
    y.mul_(2)  # sigmoid saved its output for backward: autograd must refuse
    y.sum().backward()
    print("no error", x.grad.tolist())
""")


def _last_line(text):
    return [line for line in text.splitlines() if line.strip()][-1]


def test_inplace_modification_of_a_saved_tensor_still_raises(tmp_path):
    (tmp_path / "inplace.py").write_text(INPLACE)
    plain = subprocess.run([sys.executable, "inplace.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    rec = subprocess.run([sys.executable, "-m", "tracekit.cli", "record", "-o", "r.pickle", "--", sys.executable,
                          "inplace.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 1 and rec.returncode == 1
    assert "modified by an inplace operation" in _last_line(plain.stderr)
    assert _last_line(rec.stderr) == _last_line(plain.stderr)  # autograd's own words, word for word
    assert "no error" not in rec.stdout
    assert tracekit.load(tmp_path / "r.pickle").meta["tracekit"]["exit_code"] == 1


def test_inplace_check_in_code(tmp_path):
    x = torch.tensor([0.3, -1.2, 2.0], requires_grad=True)
    with tracekit.record(tmp_path / "i.pickle", backend="cpu"):
        y = x.exp()
        y.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation.*Exp, is at version 1; expected "
                                               "version 0"):
            y.sum().backward()


def _grads(mode):
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    if mode == "checkpoint_reentrant":
        y = checkpoint(m, x.requires_grad_(), use_reentrant=True)
    elif mode == "checkpoint":
        y = checkpoint(m, x, use_reentrant=False)
    elif mode == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu():
            y = m(x)
    else:
        y = m(x)
    y.sigmoid().pow(2).sum().backward()
    return [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("mode", ["plain", "checkpoint", "checkpoint_reentrant", "save_on_cpu"])
def test_gradients_are_bit_identical(mode, tmp_path):
    expected = _grads(mode)
    with tracekit.record(tmp_path / "g.pickle", backend="cpu"):
        got = _grads(mode)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert any(a.abs().sum() > 0 for a in got)
    assert (tmp_path / "g.pickle").exists()


def test_users_own_saved_tensor_hooks_are_left_on_top(tmp_path):
    """save_on_cpu entered before recording: ours are not pushed over it (that would turn its offload off)."""
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(1) or t, lambda t: t):
        with pytest.warns(RuntimeWarning, match="saved-tensor hooks of your own"):
            with tracekit.record(tmp_path / "h.pickle", backend="cpu"):
                x = torch.randn(4, requires_grad=True)
                x.exp().sum().backward()
    assert seen  # the user's pack hook ran


def test_torch_func_transforms_run_unchanged_with_one_warning(tmp_path):
    from torch.func import grad, hessian, jacrev, vjp

    def f(x):
        return (x.sin() * x).sum()

    x = torch.linspace(-1, 1, 5)

    def all_of_them():
        return [grad(f)(x), vjp(f, x)[1](torch.tensor(1.0))[0], jacrev(f)(x), hessian(f)(x)]

    expected = all_of_them()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracekit.record(tmp_path / "f.pickle", backend="cpu"):
            got = all_of_them()
            got += all_of_them()
            # our hooks are back on the stack after each transform: ordinary autograd is still tagged
            top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    ours = [w for w in caught if "torch.func" in str(w.message)]
    assert len(ours) == 1
    assert top is not None
    assert all(torch.equal(a, b) for a, b in zip(expected * 2, got))
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    assert torch.autograd.graph.disable_saved_tensors_hooks.__module__ == "torch.autograd.graph"


@pytest.mark.slow
def test_torch_compile(tmp_path):
    def grads(record):
        torch._dynamo.reset()
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        cm = torch.compile(m)
        x = torch.randn(5, 8)
        if record:
            with tracekit.record(tmp_path / "c.pickle", model=m, backend="cpu"):
                cm(x).sin().sum().backward()
        else:
            cm(x).sin().sum().backward()
        return [p.grad.clone() for p in m.parameters()]

    try:
        expected = grads(False)
    except Exception as e:  # no C compiler here: compile itself does not work
        pytest.skip(f"torch.compile does not work here ({e!r})")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = grads(True)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert not [w for w in caught if "Dynamo does not know how to trace" in str(w.message)]
