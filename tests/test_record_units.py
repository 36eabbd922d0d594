"""Recorder pieces without a training run: marks, writer, paths, command parsing, CPU conversion."""
import io
import os
import pickle

import pytest

from tracekit.io.unpickle import restricted_load
from tracekit.io.write import write_snapshot
from tracekit.analysis.phases import _RE_METADATA
from tracekit.record.marks import Marks, metadata_string
from tracekit.record.recorder import expand_path
from tracekit.record.script import NotPython, parse_python_command


class Clock:
    def __init__(self):
        self.t = 0

    def __call__(self):
        self.t += 10
        return self.t


def test_marks_iterations_end_at_next_forward_after_optimizer_step():
    seen = []
    m = Marks(on_change=seen.append, clock=Clock())
    m.start()
    for _ in range(3):
        m.forward_started()
        m.forward_started()  # a second outermost call (e.g. the loss module) stays in forward
        m.backward_started()
        m.backward_ended()
        m.optimizer_started()
        m.optimizer_ended()
    m.finish()
    assert [i["iteration"] for i in m.iterations] == [0, 1, 2]
    assert [(p["iteration"], p["phase"]) for p in m.phases] == [
        (i, p) for i in range(3) for p in ("forward", "backward", "optimizer")]
    assert all(a["end_us"] <= b["start_us"] for a, b in zip(m.phases, m.phases[1:]))
    assert seen[:3] == ["tracekit:iter=0", "tracekit:iter=0:phase=forward", "tracekit:iter=0:phase=backward"]


def test_marks_gradient_accumulation_and_explicit_steps():
    m = Marks(clock=Clock())
    m.start()
    m.optimizer_started(), m.optimizer_ended()  # optimizer known
    m.step()
    for _ in range(2):  # two micro-batches, one optimizer step: one iteration
        m.forward_started(), m.backward_started(), m.backward_ended()
    m.optimizer_started(), m.optimizer_ended()
    m.step()
    m.finish()  # the empty trailing iteration is dropped
    assert [i["iteration"] for i in m.iterations] == [0, 1]
    assert [p["phase"] for p in m.phases if p["iteration"] == 1] == [
        "forward", "backward", "forward", "backward", "optimizer"]


def test_marks_recompute_in_backward_is_not_a_forward():
    m = Marks(clock=Clock())
    m.start()
    m.forward_started(), m.backward_started()
    assert m.forward_started() is False  # activation checkpointing re-runs forward inside backward
    m.backward_ended()
    assert [p["phase"] for p in m.phases] == ["forward", "backward"]


def test_metadata_round_trip():
    """What the recorder writes is what the analysis reads (phases.py's pattern)."""
    assert _RE_METADATA.fullmatch(metadata_string(3, "forward")).groups() == ("3", "forward")
    assert _RE_METADATA.fullmatch(metadata_string(7)).groups() == ("7", None)
    assert _RE_METADATA.fullmatch("someone else's") is None


def test_writer_is_atomic_plain_and_refuses_objects(tmp_path):
    snap = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 2, "frames": []}]],
            "tracekit": {"version": 1, "t": (0, 0), "x": None, "f": 1.5}}
    path = write_snapshot(tmp_path / "sub" / "a.pickle", snap)
    with open(path, "rb") as f:
        assert restricted_load(f) == snap
    assert os.listdir(tmp_path / "sub") == ["a.pickle"]  # no temp file left behind
    with pytest.raises(TypeError, match="plain builtins"):
        write_snapshot(tmp_path / "b.pickle", {"x": io.BytesIO()})
    assert not (tmp_path / "b.pickle").exists()
    gz = write_snapshot(tmp_path / "c.pickle.gz", snap)
    import gzip
    assert pickle.loads(gzip.decompress(open(gz, "rb").read())) == snap


def test_expand_path(monkeypatch):
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert expand_path("m-{pid}.pickle") == f"m-{os.getpid()}.pickle"
    assert expand_path("m.pickle") == "m.pickle"
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert expand_path("out/m.pickle") == "out/m.rank3.pickle"
    assert expand_path("m.pickle.gz") == "m.rank3.pickle.gz"
    assert expand_path("m-{rank}.pickle") == "m-3.pickle"


@pytest.mark.parametrize("argv, expected", [
    (["python", "train.py", "--lr", "3"], ("python", [], "path", "train.py", ["--lr", "3"])),
    (["python3", "-u", "-X", "dev", "train.py"], ("python3", ["-u", "-X", "dev"], "path", "train.py", [])),
    (["python", "-m", "pkg.train", "-m", "x"], ("python", [], "module", "pkg.train", ["-m", "x"])),
    (["python", "-um", "pkg"], ("python", ["-u"], "module", "pkg", [])),
    (["python3.11", "-c", "print(1)", "a"], ("python3.11", [], "code", "print(1)", ["a"])),
    (["python", "-Wignore", "-OO", "t.py"], ("python", ["-Wignore", "-OO"], "path", "t.py", [])),
])
def test_parse_python_command(argv, expected):
    assert parse_python_command(argv) == expected


@pytest.mark.parametrize("argv", [["bash", "run.sh"], ["python"], ["python", "-"], ["python", "-u"]])
def test_parse_python_command_refuses(argv):
    with pytest.raises(NotPython):
        parse_python_command(argv)


