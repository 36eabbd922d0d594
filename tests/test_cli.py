"""`tracekit report` and `tracekit info` as a user runs them."""
import io
import json
import os
import pickle
import subprocess
import sys

from click.testing import CliRunner

from tracekit.cli import cli
from tracekit.io.progress import StderrProgress

from .conftest import FIXTURES, fixture
from .oracle import naive_replay
from .synth import MiB, Sim

NEWEST = "snapshot_newest_format_windows_paths.pickle"


def run(*args):
    r = subprocess.run([sys.executable, "-m", "tracekit.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=120)
    return r


def test_report_json_shape_and_figures():
    r = run("report", "--json", fixture(NEWEST))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    with open(fixture(NEWEST), "rb") as f:
        from tracekit.io.unpickle import restricted_load

        naive = naive_replay(restricted_load(f))
    (d,) = out["devices"]
    assert d["device"] == 0
    assert d["peak_allocated_bytes"] == naive["peak"] and d["peak_event_index"] == naive["peak_index"] == 1402
    assert d["allocated_before_trace_bytes"] == naive["start"]
    assert d["final_allocated_bytes"] == naive["final"] and d["final_reserved_bytes"] == naive["reserved_end"]
    assert isinstance(d["peak_time_us"], int) and isinstance(d["peak_reserved_bytes"], int)
    for f in out["findings"]:
        assert {"kind", "device", "bytes", "summary", "frames"} <= set(f)
        assert isinstance(f["bytes"], int)
        for fr in f["frames"]:
            assert set(fr) == {"filename", "line", "name"}
    peak = [f for f in out["findings"] if f["kind"] == "peak"][0]
    assert peak["frames"][0]["filename"].endswith("model.py")  # user code first, not torch internals


def test_report_text_is_readable():
    r = run("report", fixture(NEWEST))
    assert r.returncode == 0
    assert "peak allocated      13.0 GiB  not exact: up to 511.5 KiB more, as torch.cuda.max_memory_allocated() counts it" in r.stdout
    assert "tensors requested 13.0 GiB (508 B less); at entry 1402" in r.stdout
    assert "live at the peak, by allocation site" in r.stdout and "model.py:39 in forward" in r.stdout


def test_report_on_every_fixture():
    for path in sorted(FIXTURES.glob("*")):
        if path.suffix == ".md" or path.name == "truth.json":  # notes and answers, not recordings
            continue
        r = run("report", "--json", path)
        assert r.returncode == 0, (path, r.stderr)
        assert json.loads(r.stdout)["devices"]


def test_info_facts():
    r = run("info", "--json", fixture(NEWEST))
    info = json.loads(r.stdout)
    (d,) = info["devices"]
    assert d["entries"] == 5163 and d["entries_with_frames"] == 1421  # SOURCES.md
    assert d["actions"] == {"alloc": 1721, "free_requested": 1721, "free_completed": 1721}
    assert "time_us" in info["present_fields"] and "allocator_settings" in info["top_level"]
    assert d["replay_check"].startswith("ok")
    text = run("info", fixture("snapshot_legacy_torch20_oom_observer.pickle")).stdout
    assert "no trace entries" not in text and "176 (" in text


def test_oom_and_multi_device_report(tmp_path):
    sim = Sim(devices=2)
    sim.alloc(6 * MiB, device=1, frames=[{"filename": "/home/me/train.py", "line": 42, "name": "forward"},
                                         {"filename": "/usr/lib/python3/site-packages/torch/nn/modules/module.py",
                                          "line": 1, "name": "_call_impl"}])
    sim.alloc(MiB)
    sim.oom(64 * MiB, device_free=2 * MiB, device=1)
    p = tmp_path / "oom.pickle"
    p.write_bytes(pickle.dumps(sim.snapshot(), protocol=4))
    out = json.loads(CliRunner().invoke(cli, ["report", "--json", str(p)]).output)
    assert [d["device"] for d in out["devices"]] == [0, 1]
    assert out["devices"][1]["oom_count"] == 1
    (oom,) = [f for f in out["findings"] if f["kind"] == "oom"]
    assert oom["device"] == 1 and oom["bytes"] == 64 * MiB and oom["device_free_bytes"] == 2 * MiB
    assert oom["allocated_bytes"] == 6 * MiB
    assert oom["top_stacks"][0]["frames"][0] == {"filename": "/home/me/train.py", "line": 42, "name": "forward"}


def test_progress_appears_only_after_a_second():
    import io

    now = [100.0]
    stream = io.StringIO()
    p = StderrProgress("opening x", stream=stream, clock=lambda: now[0], interactive=True)
    now[0] += 0.9
    p(0.1, "reading")
    assert stream.getvalue() == ""
    now[0] += 0.2
    p(0.5, "reading")
    assert "opening x" in stream.getvalue() and "50%" in stream.getvalue()
    p.close()
    assert stream.getvalue().endswith("\r")


class _Log(io.StringIO):
    def isatty(self):
        return False


class _Terminal(_Log):
    def isatty(self):
        return True


def test_progress_only_on_a_terminal():
    """A log or a pipe gets no progress at all (no redraws, no clearing); a terminal gets the bar."""
    now = [0.0]
    for stream, shown in ((_Log(), False), (_Terminal(), True)):
        p = StderrProgress("opening x", stream=stream, clock=lambda: now[0])
        now[0] += 5
        for i in range(10):
            p(i / 10, "reading")
        p.close()
        assert ("opening x" in stream.getvalue()) == shown and (stream.getvalue() == "") != shown


def test_help_lists_every_command_with_its_line():
    """`tracekit --help` lists each command once, in the table's order, with the table's one-line help."""
    from tracekit.cli import COMMANDS

    r = run("--help")
    assert r.returncode == 0
    section = r.stdout.split("Commands:", 1)[1]
    rows = [line.split(None, 1) for line in section.splitlines() if line.startswith("  ") and line.strip()
            and not line.startswith("    ")]
    assert [name for name, _ in rows] == list(COMMANDS)
    for name, text in rows:
        assert " ".join(COMMANDS[name].split()).startswith(" ".join(text.split())[:40]), name


def test_report_needs_neither_torch_nor_qt():
    code = ("import sys; from tracekit.cli import main; "
            "sys.argv = ['tracekit', 'report', sys.argv[1]]\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "bad = [m for m in ('torch', 'PySide6', 'pyqtgraph', 'gui', 'tracekit_gui') if m in sys.modules]\n"
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code, str(fixture(NEWEST))], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_view_without_a_display_says_so(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    r = subprocess.run([sys.executable, "-m", "tracekit.cli", "view", str(fixture(NEWEST))], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 2 and "there is no display" in r.stderr and "Traceback" not in r.stderr


def test_record_a_missing_script_is_a_usage_error(tmp_path):
    r = run("record", "-o", tmp_path / "x.pickle", "--", sys.executable, tmp_path / "missing.py")
    assert r.returncode == 2 and "cannot open the script" in r.stderr and "Traceback" not in r.stderr


def test_cache_command_lists_and_clears(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path / "c"))
    runner = CliRunner()
    assert "0 cached files" in runner.invoke(cli, ["cache"]).output
    runner.invoke(cli, ["report", str(fixture(NEWEST))])
    assert "1 cached files" in runner.invoke(cli, ["cache"]).output
    assert "removed 1 cached files" in runner.invoke(cli, ["cache", "--clear"]).output
    assert "0 cached files" in runner.invoke(cli, ["cache"]).output


def test_demo_without_torch_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    result = CliRunner().invoke(cli, ["demo", "--no-open"])
    assert result.exit_code == 2
    assert "pip install 'torch-tracekit[record]'" in result.output and "Traceback" not in result.output


def test_demo_writes_into_the_cache_folder(tmp_path, monkeypatch):
    """TRACEKIT_CACHE_DIR moves demo.pickle too; nothing lands in the home folder."""
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    result = CliRunner().invoke(cli, ["demo", "--no-open", "--steps", "1", "--backend", "cpu"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "cache" / "demo.pickle").stat().st_size > 0
    assert not (tmp_path / "home").exists()


def test_a_raw_memory_timeline_is_not_labelled_cuda():
    """export_memory_timeline's raw file names no device: the report says so instead of guessing cuda:0."""
    out = json.loads(run("report", "--json", fixture("profiler_memory_timeline_raw.json.gz")).stdout)
    assert [d["label"] for d in out["devices"]] == ["(device not in file)"]


def test_installed_under_names_of_its_own():
    """The distribution is torch-tracekit; it installs the packages tracekit and tracekit_gui, no bare `gui`."""
    from importlib.metadata import distribution

    dist = distribution("torch-tracekit")
    assert sorted(dist.read_text("top_level.txt").split()) == ["tracekit", "tracekit_gui"]
    assert any(e.name == "tracekit" and e.value == "tracekit.cli:main" for e in dist.entry_points)


def test_a_reader_that_goes_away_is_no_bug():
    """`tracekit report --json FILE | head -c 1`: the pipe closes before the report is written; tracekit stops
    quietly (no 'this is a bug', no traceback) with a non-zero status, as click's own commands do."""
    from .conftest import SAMPLES
    p = subprocess.Popen([sys.executable, "-m", "tracekit", "report", "--json", str(SAMPLES / "gpt_adamw.pickle")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # closed before anything is written: the first write fails with EPIPE
    err = p.stderr.read().decode()
    assert p.wait() in (1, 141), err
    assert "bug" not in err and "Traceback" not in err, err
