"""Where the recording goes: refused before the script starts when it cannot be written, format by name, umask."""
import gzip
import io
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

import tracekit  # noqa: E402
from tracekit.io.unpickle import restricted_load  # noqa: E402
from tracekit.io.write import check_writable, output_format  # noqa: E402

SCRIPT = "open('ran', 'w').write('yes')\n"


def record_cli(tmp_path, output):
    (tmp_path / "s.py").write_text(SCRIPT)
    return subprocess.run([sys.executable, "-m", "tracekit.cli", "record", "-o", output, "--", sys.executable, "s.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("output, why", [
    ("afile/x.pickle", "afile is not a folder"),  # a file where the folder should be
    ("sub", "cannot tell the format"),  # a folder
    ("x.txt", "cannot tell the format from the name"),
    ("/proc/no/x.pickle", "cannot create a file in /proc"),
])
def test_unwritable_output_is_refused_before_the_script_runs(tmp_path, output, why):
    (tmp_path / "afile").write_text("")
    (tmp_path / "sub").mkdir()
    r = record_cli(tmp_path, output)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tracekit: cannot write the recording to") and why in lines[0]
    assert not (tmp_path / "ran").exists()


def test_read_only_folder_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:  # root may write into a 0555 folder; sysfs takes no new file even from root
        ro = "/sys"
    with pytest.raises(ValueError, match="cannot create a file"):
        check_writable(os.path.join(ro, "x.pickle"))


def test_missing_folders_are_fine_and_nothing_is_left_behind(tmp_path):
    check_writable(tmp_path / "a" / "b" / "x.pickle")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name, fmt", [
    ("a.pickle", ("pickle", False)), ("a.PKL", ("pickle", False)), ("a.pickle.gz", ("pickle", True)),
    ("a.json", ("json", False)), ("a.json.gz", ("json", True)),
])
def test_output_format(name, fmt):
    assert output_format(name) == fmt


def test_in_code_unknown_suffix_is_refused_at_once():
    with pytest.raises(ValueError, match="cannot tell the format"):
        tracekit.record("x.txt")


def test_in_code_unwritable_path_warns_and_training_runs(tmp_path):
    import torch

    (tmp_path / "afile").write_text("")
    model = torch.nn.Linear(4, 2)
    with pytest.warns(RuntimeWarning, match="cannot write the recording"):
        with tracekit.record(tmp_path / "afile" / "x.pickle", model=model, backend="cpu") as rec:
            model(torch.randn(3, 4)).sum().backward()
    assert rec.written is None
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None


def _record(path):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    with tracekit.record(path, model=model, backend="cpu"):
        model(torch.randn(3, 4)).sum().backward()


@pytest.mark.parametrize("name", ["r.json", "r.json.gz", "r.pickle.gz"])
def test_format_follows_the_name(tmp_path, name):
    path = tmp_path / name
    _record(path)
    raw = path.read_bytes()
    if name.endswith(".gz"):
        raw = gzip.decompress(raw)
    if ".json" in name:
        snap = json.loads(raw)
    else:
        assert raw[:2] == b"\x80\x04"  # pickle protocol 4
        snap = restricted_load(io.BytesIO(raw))
    assert snap["tracekit"]["backend"] == "cpu"
    trace = tracekit.load(path, use_cache=False)
    assert len(trace.events) == len(snap["device_traces"][0]) > 0


@pytest.mark.parametrize("mask", [0o077, 0o022, 0o002])
def test_recordings_honour_the_umask(tmp_path, mask):
    old = os.umask(mask)
    try:
        _record(tmp_path / "u.pickle")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "u.pickle").st_mode & 0o777 == 0o666 & ~mask
