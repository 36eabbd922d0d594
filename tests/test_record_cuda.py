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
    monkeypatch.setattr(recorder_module, "make_backend",
                        lambda name, stacks, max_entries: MockedCuda(stacks=stacks, max_entries=max_entries))
    return mem


def test_cuda_backend_records_tags_and_restores(fake, tmp_path):
    model, optimizer, step = make_training(seed=0, **SMALL)
    with tk_record.record(tmp_path / "c.pickle", model=model, optimizer=optimizer, max_entries=1234) as rec:
        for _ in range(2):
            step()
            rec.step()
    assert fake.calls[0] == ("all", "all", "python", 1234, True)
    assert fake.calls[-1][0] is None  # history off again: it was off before
    assert fake.metadata == "theirs"  # the previous metadata string is back
    assert "tracekit:iter=0:phase=forward" in fake.metadata_log
    assert "tracekit:iter=1:phase=optimizer" in fake.metadata_log
    with open(rec.written, "rb") as f:
        snap = restricted_load(f)
    k = snap["tracekit"]
    assert k["backend"] == "cuda" and k["devices"][0]["name"] == "Fake GPU"
    assert snap["segments"][0]["segment_type"] == "large"  # the allocator's own segments, as they are
    assert [(p["iteration"], p["phase"]) for p in k["phases"]] == [
        (i, p) for i in range(2) for p in ("forward", "backward", "optimizer")]
    assert {"parameter", "gradient", "optimizer_state", "activation", "input"} <= {t["kind"] for t in k["tags"]}


def test_cuda_keeps_a_history_someone_else_started(fake, tmp_path):
    fake.enabled = True
    with tk_record.record(tmp_path / "k.pickle"):
        pass
    assert fake.calls == [("all", "all", "python", 1_000_000, False)]  # not cleared, not switched off


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
