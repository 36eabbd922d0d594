"""The recorder holds nothing of the user's (issue 26): models, optimizers, tensors and frames built and
dropped while recording are freed (weakref + gc.collect()), given ones too once dropped, and after the
context nothing of the recorder stays in the process (hooks, modes, patches, global registries)."""
import gc
import weakref

import pytest

torch = pytest.importorskip("torch")

import tracekit  # noqa: E402
from tracekit.record.toy import make_training  # noqa: E402


def _global_state():
    """Everything a recorder installs process-wide, as comparable values."""
    import torch.autograd as autograd
    import torch.autograd.profiler as profiler
    import torch.nn.modules.module as nn_module
    import torch.optim.optimizer as optim
    from torch.overrides import _get_current_function_mode_stack

    state = {
        "module pre-hooks": len(nn_module._global_forward_pre_hooks),
        "module hooks": len(nn_module._global_forward_hooks),
        "optimizer pre-hooks": len(optim._global_optimizer_pre_hooks),
        "optimizer post-hooks": len(optim._global_optimizer_post_hooks),
        "function modes": len(_get_current_function_mode_stack()),
        "saved-tensor hooks": torch._C._autograd._top_saved_tensors_default_hooks(True),
        "profiler on": bool(torch._C._autograd._profiler_enabled()),
        "backward": autograd.backward, "grad": autograd.grad,
        "engine": getattr(autograd, "_engine_run_backward", None),
        "profiler functions": (profiler._prepare_profiler, profiler._enable_profiler, profiler._disable_profiler),
        "record_function": (profiler.record_function.__enter__, profiler.record_function.__exit__),
        "disable hooks": torch.autograd.graph.disable_saved_tensors_hooks,
    }
    try:
        from tracekit.record import _cpuhook

        hook = _cpuhook.state()
        state["allocation hook"] = (hook["installed"], hook["recording"])
    except ImportError:
        pass
    return state


def _build_and_train(refs, steps=2):
    """A model, its optimizer and a batch made here and dropped on return; weak references to each kind."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, 64)
    for _ in range(steps):
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    refs["module"].append(weakref.ref(model))
    refs["submodule"].append(weakref.ref(model[0]))
    refs["parameter"].append(weakref.ref(model[0].weight))
    refs["optimizer"].append(weakref.ref(optimizer))
    refs["optimizer state"].append(weakref.ref(optimizer.state[model[0].weight]["exp_avg"]))
    refs["input"].append(weakref.ref(x))
    refs["output"].append(weakref.ref(loss))


def _refs():
    return {k: [] for k in ("module", "submodule", "parameter", "optimizer", "optimizer state", "input", "output")}


def _alive(refs):
    gc.collect()
    return {k: sum(r() is not None for r in v) for k, v in refs.items() if any(r() is not None for r in v)}


def _train(refs):
    _build_and_train(refs)


@pytest.mark.parametrize("given", [False, True])
def test_objects_built_and_dropped_while_recording_are_freed(tmp_path, given):
    refs = _refs()
    before = _global_state()
    model, optimizer, step = make_training(seed=0, n_layers=1, d_model=32, vocab=256, seq=16, batch=2)
    kwargs = {"model": model, "optimizer": optimizer} if given else {}
    with tracekit.record(tmp_path / "r.pickle", backend="cpu", **kwargs) as rec:
        step()
        for _ in range(3):
            _train(refs)
            assert _alive(refs) == {}, "kept alive while recording"
        rec.step()
    assert rec.written
    assert _alive(refs) == {}
    # the given model and optimizer too, once the user drops them (the recorder object still exists)
    m, o = weakref.ref(model), weakref.ref(optimizer)
    del model, optimizer, step, kwargs
    gc.collect()
    assert m() is None and o() is None
    assert _global_state() == before


def test_tensors_saved_for_backward_and_frames_die_with_them(tmp_path):
    """A function's locals (its frame) and the tensors autograd saved are freed when the graph and the
    frame go, also when a module's forward raised (the running-module stack keeps no frame)."""
    seen = []

    class Fails(torch.nn.Module):
        def forward(self, x):
            big = torch.ones(256, 256) * x.sum()
            seen.append(weakref.ref(big))
            raise ValueError("boom")

    def forward_and_drop():
        a = torch.randn(128, 128, requires_grad=True)
        b = (a @ a).softmax(-1)  # saves its output
        seen.append(weakref.ref(b))
        seen.append(weakref.ref(a))
        return b.sum().item()

    with tracekit.record(tmp_path / "s.pickle", backend="cpu"):
        forward_and_drop()
        with pytest.raises(ValueError):
            Fails()(torch.ones(2))
        gc.collect()
        assert all(r() is None for r in seen)


def test_nothing_left_after_an_error_inside_the_block(tmp_path):
    before = _global_state()
    with pytest.raises(RuntimeError, match="in the step"):
        with tracekit.record(tmp_path / "e.pickle", backend="cpu"):
            torch.ones(4).sum()
            raise RuntimeError("in the step")
    assert _global_state() == before
