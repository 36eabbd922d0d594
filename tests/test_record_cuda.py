"""The CUDA backend: with torch.cuda.memory mocked here (no GPU), and for real where CUDA exists."""
import pytest

torch = pytest.importorskip("torch")

import tracekit  # noqa: E402
import tracekit.record as tk_record  # noqa: E402
from tracekit.io.unpickle import restricted_load  # noqa: E402
from tracekit.record import cuda as cuda_backend  # noqa: E402
from tracekit.record import recorder as recorder_module  # noqa: E402
from tracekit.record.toy import make_training  # noqa: E402

SMALL = dict(vocab=256, d_model=32, n_layers=1, n_heads=2, seq=16, batch=4)


class FakeMemory:
    """Stands in for torch.cuda.memory: remembers what the recorder asked for."""

    def __init__(self, enabled=False, metadata="theirs"):
        self.enabled = enabled
        self.metadata = metadata
        self.calls = []
        self.metadata_log = []

    def _record_memory_history(self, enabled="all", context="all", stacks="all", max_entries=2**63 - 1,
                               device=None, clear_history=False):
        self.calls.append((enabled, context, stacks, max_entries, clear_history))
        self.enabled = enabled is not None

    def _set_memory_metadata(self, s):
        self.metadata = s
        self.metadata_log.append(s)

    def _get_memory_metadata(self):
        return self.metadata

    def _snapshot(self):
        entry = {"action": "alloc", "addr": 4096, "size": 512, "stream": 0, "time_us": 1,
                 "frames": [], "user_metadata": self.metadata}
        block = {"address": 4096, "size": 512, "requested_size": 512, "state": "active_allocated", "frames": []}
        seg = {"device": 0, "address": 4096, "total_size": 2097152, "allocated_size": 512, "active_size": 512,
               "requested_size": 512, "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
               "is_expandable": False, "frames": [], "blocks": [block]}
        return {"segments": [seg], "device_traces": [[entry]]}


@pytest.fixture
def fake(monkeypatch):
    mem = FakeMemory()

    class MockedCuda(cuda_backend.CudaBackend):
        @staticmethod
        def _memory():
            return mem

        def device_of(self, tensor):  # CPU tensors stand in for CUDA ones
            return 0

        def devices(self):
            return [{"index": 0, "type": "cuda", "name": "Fake GPU", "total_memory": 80 * 2**30}]

    monkeypatch.setattr(cuda_backend, "history_enabled", lambda: mem.enabled)
    monkeypatch.setattr(cuda_backend, "cuda_initialized", lambda: True)  # a GPU already in use
    monkeypatch.setattr(recorder_module, "make_backend",
                        lambda name, stacks, max_entries, **kw: MockedCuda(stacks=stacks, max_entries=max_entries, **kw))
    return mem


def test_cuda_backend_records_tags_and_restores(fake, tmp_path):
    model, optimizer, step = make_training(seed=0, **SMALL)
    with tk_record.record(tmp_path / "c.pickle", model=model, optimizer=optimizer, max_entries=1234) as rec:
        for _ in range(2):
            step()
            rec.step()
    # no stacks gathered by the allocator: the op log names each entry's call through its metadata
    assert fake.calls[0] == ("all", None, "python", 1234, True)
    assert fake.calls[-1][0] is None  # history off again: it was off before
    assert fake.metadata == "theirs"  # the previous metadata string is back
    assert "tracekit:iter=0:phase=forward" in fake.metadata_log
    assert "tracekit:iter=1:phase=optimizer" in fake.metadata_log
    assert any(":op=" in m for m in fake.metadata_log)
    with open(rec.written, "rb") as f:
        snap = restricted_load(f)
    (entry,) = snap["device_traces"][0]
    assert ":op=" not in entry["user_metadata"]  # taken off again
    k = snap["tracekit"]
    assert k["settings"]["cuda_context"] is None and k["settings"]["checkpoint_early_stop"] is False
    assert k["backend"] == "cuda" and k["devices"][0]["name"] == "Fake GPU"
    assert snap["segments"][0]["segment_type"] == "large"  # the allocator's own segments, as they are
    assert [(p["iteration"], p["phase"]) for p in k["phases"]] == [
        (i, p) for i in range(2) for p in ("forward", "backward", "optimizer")]
    assert {"parameter", "gradient", "optimizer_state", "activation", "input"} <= {t["kind"] for t in k["tags"]}


def test_cuda_keeps_a_history_someone_else_started(fake, tmp_path):
    fake.enabled = True
    with pytest.warns(RuntimeWarning, match="CUDA memory history was already on"):
        with tk_record.record(tmp_path / "k.pickle"):
            pass
    assert fake.calls == []  # its settings kept as they are: not changed, not cleared, not switched off


def test_cuda_full_detail_asks_torch_for_every_stack(fake, tmp_path):
    with tk_record.record(tmp_path / "f.pickle", stacks="all"):
        torch.ones(4).sum()
    assert fake.calls[0][:3] == ("all", "all", "all")


def test_cuda_checkpoint_early_stop_is_off_while_recording_and_put_back(fake, tmp_path):
    """Non-reentrant checkpointing with early stop crashes torch's CUDA history: off while we record."""
    from torch.utils import checkpoint

    def early_stop():
        return checkpoint._enable_checkpoint_early_stop if hasattr(checkpoint, "_enable_checkpoint_early_stop") \
            else None

    before = early_stop()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    plain = torch.autograd.grad(checkpoint.checkpoint(model, x, use_reentrant=False).sum(), x)[0]
    with tk_record.record(tmp_path / "cp.pickle", model=model):
        assert early_stop() is False
        got = torch.autograd.grad(checkpoint.checkpoint(model, x, use_reentrant=False).sum(), x)[0]
    assert early_stop() == before
    assert torch.equal(plain, got)


def test_cuda_out_of_memory_dumps_then_reraises(fake, tmp_path):
    model, optimizer, step = make_training(seed=0, **SMALL)
    with pytest.raises(torch.OutOfMemoryError):
        with tk_record.record(tmp_path / "oom.pickle", model=model, optimizer=optimizer):
            step()
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    with open(tmp_path / "oom.pickle", "rb") as f:
        snap = restricted_load(f)
    assert snap["tracekit"]["error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert snap["device_traces"][0][0]["action"] == "alloc"
    assert fake.calls[-1][0] is None


def test_supported_kwargs_drops_what_old_torch_lacks():
    def old(enabled="all", context="all", stacks="all", max_entries=1):
        pass

    got = cuda_backend.supported_kwargs(old, {"context": "all", "max_entries": 5, "clear_history": True})
    assert got == {"context": "all", "max_entries": 5}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_cuda_recording(tmp_path):
    from tracekit.analysis.replay import replay

    model, optimizer, step = make_training(seed=0, device="cuda", **SMALL)
    path = tk_record.record_steps(step, steps=2, warmup=1, path=tmp_path / "gpu.pickle",
                                  model=model, optimizer=optimizer, backend="cuda")
    trace = tracekit.load(path, use_cache=False)
    k = trace.recorder
    assert k["backend"] == "cuda" and k["devices"][0]["type"] == "cuda"
    assert [(p["iteration"], p["phase"]) for p in k["phases"]] == [
        (i, p) for i in (1, 2) for p in ("forward", "backward", "optimizer")]
    for rep in replay(trace).values():
        assert rep.invariant.ok, rep.invariant.problems
    with open(path, "rb") as f:
        metas = {e.get("user_metadata") for e in restricted_load(f)["device_traces"][0]}
    assert "tracekit:iter=1:phase=backward" in metas
    assert not torch._C._cuda_isHistoryEnabled()


def needs_cuda(test):
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))

TRAIN = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "samples" / "cuda_train.py")


def _losses(record_to=None, **options):
    """Three fp32 AdamW steps of the toy GPT on CUDA from fixed seeds, recorded to `record_to` if given."""
    model, optimizer, step = make_training(seed=0, device="cuda", **SMALL)
    if record_to is None:
        return [step().item() for _ in range(3)]
    with tk_record.record(record_to, model=model, optimizer=optimizer, backend="cuda", **options) as rec:
        out = []
        for _ in range(3):
            out.append(step().item())
            rec.step()
    return out


@needs_cuda
@pytest.mark.parametrize("options", [{}, {"stacks": "all"}, {"activations": False}])
def test_real_cuda_numerics_bit_identical(tmp_path, options):
    plain, again = _losses(), _losses()
    if plain != again:
        pytest.skip(f"this GPU is not deterministic from run to run ({plain} vs {again})")
    recorded = _losses(tmp_path / "n.pickle", **options)
    assert [x.hex() for x in recorded] == [x.hex() for x in plain]
    assert (tmp_path / "n.pickle").exists()



def _report(path):
    from tracekit.analysis.report import build_report

    return build_report(tracekit.load(path, use_cache=False))


@needs_cuda
def test_real_cuda_peak_equals_the_allocators(tmp_path):
    model, optimizer, step = make_training(seed=0, device="cuda", **SMALL)
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with tk_record.record(tmp_path / "p.pickle", model=model, optimizer=optimizer, backend="cuda") as rec:
        for _ in range(2):
            step()
            rec.step()
    stats = tracekit.load(tmp_path / "p.pickle", use_cache=False).recorder["devices"][0]["allocator_stats"]
    assert stats["max_memory_allocated"] == torch.cuda.max_memory_allocated()
    rep = _report(tmp_path / "p.pickle")
    dev = rep["devices"][0] if isinstance(rep.get("devices"), list) else next(iter(rep["devices"].values()))
    assert dev["peak_allocated_block_bytes"] == stats["max_memory_allocated"], (dev, stats)


@needs_cuda
def test_real_cuda_keeps_the_users_history_and_metadata(tmp_path):
    mem = torch.cuda.memory
    mem._record_memory_history("all", stacks="python")
    try:
        if hasattr(mem, "_set_memory_metadata"):
            mem._set_memory_metadata("users-own")
        before = torch.empty(1 << 20, device="cuda")
        model, optimizer, step = make_training(seed=0, device="cuda", **SMALL)
        with tk_record.record(tmp_path / "h.pickle", model=model, optimizer=optimizer, backend="cuda") as rec:
            step()
            rec.step()
        assert torch._C._cuda_isHistoryEnabled()
        after = torch.empty(1 << 20, device="cuda")
        snap = mem._snapshot()
        addrs = {e["addr"] for e in snap["device_traces"][0] if e["action"] == "alloc"}
        assert before.data_ptr() in addrs and after.data_ptr() in addrs
        if hasattr(mem, "_get_memory_metadata"):
            assert mem._get_memory_metadata() == "users-own"
    finally:
        mem._record_memory_history(None)


@needs_cuda
def test_real_cuda_out_of_memory_post_mortem(tmp_path):
    """A step that cannot fit under a per-process memory fraction: the file is written, the error re-raised,
    and the report names the request, the free memory and the live memory by user line."""
    import subprocess
    import sys

    path = tmp_path / "oom.pickle"
    p = subprocess.run([sys.executable, TRAIN, "oom", "--steps", "1", "--record", str(path)],
                       capture_output=True, text=True)
    assert p.returncode == 1 and "OutOfMemoryError" in p.stderr, p.stderr[-2000:]
    assert path.exists(), p.stderr[-2000:]
    rep = _report(path)
    ooms = [f for f in rep["findings"] if f["kind"] == "oom"]
    assert ooms, rep["findings"]
    text = str(ooms[0])
    assert "cuda_train.py" in text, text



def test_cuda_history_waits_for_cuda_initialisation(fake, monkeypatch, tmp_path):
    """`tracekit record` starts before the script initialises CUDA; torch's history probe and metadata calls
    index the allocator's per-device state, which does not exist yet (a segfault on a real GPU): the history
    starts when torch initialises CUDA, and we never initialise it ourselves."""
    state = {"initialized": False, "queued": []}

    def touch(*args):
        if not state["initialized"]:
            raise AssertionError("the allocator was touched before CUDA was initialised")

    for name in ("_get_memory_metadata", "_set_memory_metadata", "_record_memory_history", "_snapshot"):
        original = getattr(fake, name)
        monkeypatch.setattr(fake, name, lambda *a, _f=original, **k: touch() or _f(*a, **k))
    monkeypatch.setattr(cuda_backend, "history_enabled", lambda: touch() or fake.enabled)
    monkeypatch.setattr(cuda_backend, "cuda_initialized", lambda: state["initialized"])
    monkeypatch.setattr(cuda_backend, "_on_cuda_init", state["queued"].append)
    model, optimizer, step = make_training(seed=0, **SMALL)
    rec = tk_record.record(tmp_path / "c.pickle", model=model, optimizer=optimizer).start()
    assert fake.calls == [] and len(state["queued"]) == 1  # waits
    state["initialized"] = True
    state["queued"].pop()()  # torch runs the queued call as CUDA initialises
    assert fake.calls[0][0] == "all" and fake.metadata_log == ["tracekit:iter=0"]
    step()
    rec.step()
    rec.close()
    assert "tracekit:iter=0:phase=forward" in fake.metadata_log
    assert fake.metadata == "theirs" and fake.calls[-1][0] is None  # restored


def test_cuda_never_initialised_writes_an_empty_recording(fake, monkeypatch, tmp_path):
    monkeypatch.setattr(cuda_backend, "cuda_initialized", lambda: False)
    monkeypatch.setattr(cuda_backend, "_on_cuda_init", lambda fn: None)
    model, optimizer, step = make_training(seed=0, **SMALL)
    with pytest.warns(RuntimeWarning, match="no trace entries"):
        with tk_record.record(tmp_path / "e.pickle", model=model, optimizer=optimizer) as rec:
            step()
            rec.step()
    assert fake.calls == [] and (tmp_path / "e.pickle").exists()


@needs_cuda
def test_real_cuda_cli_records_a_fresh_process(tmp_path):
    """`tracekit record -- python script.py`: the recorder starts before the script initialises CUDA."""
    import subprocess
    import sys

    path = tmp_path / "cli.pickle"
    p = subprocess.run([sys.executable, "-m", "tracekit.cli", "record", "-o", str(path), "--",
                        sys.executable, TRAIN, "gpt", "--steps", "2"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    trace = tracekit.load(path, use_cache=False)
    assert [(ph["iteration"], ph["phase"]) for ph in trace.recorder["phases"]][:3] == [
        (0, "forward"), (0, "backward"), (0, "optimizer")]
    rep = _report(path)["devices"][0]
    assert rep["replay_invariant"]["ok"] and rep["peak_phase"] in ("forward", "backward", "optimizer")
