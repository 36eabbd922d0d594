"""`tracekit record -- python ...`: an unmodified script, its output, arguments and exit code passed through."""
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

import tracekit  # noqa: E402
from tracekit.analysis.replay import replay  # noqa: E402
from tracekit.io.unpickle import restricted_load  # noqa: E402

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    print("argv", sys.argv)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(8, 16)
    for i in range(3):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"loss {loss.item():.10f}")
    if "--fail" in sys.argv:
        raise RuntimeError("boom")
    sys.exit(int(sys.argv[1]))
""")


def run(args, cwd):
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)


def tracekit_record(args, cwd):
    return run([sys.executable, "-m", "tracekit.cli", "record", *args], cwd)


def load_key(path):
    with open(path, "rb") as f:
        return restricted_load(f)["tracekit"]


@pytest.fixture
def script(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    return tmp_path


def test_script_output_arguments_and_exit_code_pass_through(script):
    plain = run([sys.executable, "train.py", "3", "--lr", "3e-4"], script)
    rec = tracekit_record(["-o", "out.pickle", "--", sys.executable, "train.py", "3", "--lr", "3e-4"], script)
    assert plain.returncode == 3 and rec.returncode == 3
    assert rec.stdout == plain.stdout  # same argv, same losses to the last digit
    assert "argv ['train.py', '3', '--lr', '3e-4']" in rec.stdout
    k = load_key(script / "out.pickle")
    assert k["exit_code"] == 3 and k["error"] is None
    assert k["command"] == [sys.executable, "train.py", "3", "--lr", "3e-4"]
    assert [(p["iteration"], p["phase"]) for p in k["phases"]] == [
        (i, p) for i in range(3) for p in ("forward", "backward", "optimizer")
    ]
    assert {"parameter", "gradient", "optimizer_state", "activation", "input"} <= {t["kind"] for t in k["tags"]}
    (rep,) = replay(tracekit.load(script / "out.pickle", use_cache=False)).values()
    assert rep.invariant.ok, rep.invariant.problems


def test_failing_script_leaves_a_usable_file(script):
    plain = run([sys.executable, "train.py", "0", "--fail"], script)
    rec = tracekit_record(["-o", "fail-{pid}.pickle", "--", sys.executable, "train.py", "0", "--fail"], script)
    assert plain.returncode == rec.returncode == 1
    assert rec.stdout == plain.stdout
    # The traceback starts at the script, as without the recorder.
    assert rec.stderr.split("Traceback")[1] == plain.stderr.split("Traceback")[1]
    (path,) = script.glob("fail-*.pickle")
    k = load_key(path)
    assert k["exit_code"] == 1 and k["error"] == "RuntimeError: boom"
    assert len(k["iterations"]) == 3
    (rep,) = replay(tracekit.load(path, use_cache=False)).values()
    assert rep.invariant.ok


def test_module_mode_and_steps_window(script):
    (script / "pkg").mkdir()
    (script / "pkg" / "__init__.py").write_text("")
    (script / "pkg" / "train.py").write_text(SCRIPT)
    rec = tracekit_record(["-o", "m.pickle", "--warmup", "1", "--steps", "1", "--",
                           sys.executable, "-m", "pkg.train", "0"], script)
    assert rec.returncode == 0, rec.stderr
    assert "argv [" in rec.stdout and rec.stdout.count("loss") == 3
    k = load_key(script / "m.pickle")
    assert [i["iteration"] for i in k["iterations"]] == [1]
    assert [(p["iteration"], p["phase"]) for p in k["phases"]] == [(1, "forward"), (1, "backward"), (1, "optimizer")]
    assert k["settings"]["warmup"] == 1 and k["settings"]["steps"] == 1


def test_not_a_python_command_is_a_usage_error(script):
    rec = tracekit_record(["--", "ls", "-l"], script)
    assert rec.returncode == 2
    assert "not a Python interpreter" in rec.stderr


def test_fresh_import_tracekit_record_is_callable(tmp_path):
    code = ("import tracekit, torch\n"
            "with tracekit.record('api.pickle', backend='cpu') as rec:\n"
            "    torch.ones(100).sum()\n"
            "print(rec.written)\n")
    done = run([sys.executable, "-c", code], tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "api.pickle").exists()
