"""Ctrl-C and SIGTERM reach a recorded script as they would without us, and leave a valid, partial file."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("torch")

import tracekit  # noqa: E402

LOOP = textwrap.dedent("""
    import signal, sys, time, torch
    print("sigint", signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)
    if "--own-handler" in sys.argv:
        signal.signal(signal.SIGTERM, lambda s, f: sys.exit(7))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16)
    {record}
    for i in range(3):
        model(x).pow(2).mean().backward(); opt.step(); opt.zero_grad()
    print("started", flush=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        model(x).pow(2).mean().backward(); opt.step(); opt.zero_grad()
    sys.exit(5)
""")


def start(tmp_path, args, record="", new_session=False):
    (tmp_path / "loop.py").write_text(LOOP.replace("{record}", record))  # record: start recording in code
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=new_session)
    first = proc.stdout.readline()
    assert proc.stdout.readline().strip() == "started", proc.stderr.read()
    time.sleep(0.5)
    return proc, first


def finish(proc):
    out, err = proc.communicate(timeout=300)
    return proc.returncode, err


def recorded(tmp_path, new_session=False, extra=()):
    return start(tmp_path, [sys.executable, "-m", "tracekit.cli", "record", "-o", "s.pickle", "--",
                            sys.executable, "loop.py", *extra], new_session=new_session)


def partial_key(path):
    trace = tracekit.load(path, use_cache=False)
    assert len(trace.events) > 0
    return trace.recorder


def test_sigterm_to_tracekit_record_leaves_a_partial_file(tmp_path):
    proc, first = recorded(tmp_path)
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc)
    assert code == 128 + signal.SIGTERM, err
    assert "partial: SIGTERM" in err
    k = partial_key(tmp_path / "s.pickle")
    assert (k["partial"], k["signal"], k["exit_code"]) == (True, "SIGTERM", 143)


def test_ctrl_c_reaches_the_script_and_leaves_a_partial_file(tmp_path):
    proc, first = recorded(tmp_path)
    assert first.strip() == "sigint True"  # Ctrl-C is not ignored in the script
    proc.send_signal(signal.SIGINT)
    code, err = finish(proc)
    assert code == 128 + signal.SIGINT, err
    assert "KeyboardInterrupt" in err
    k = partial_key(tmp_path / "s.pickle")
    assert (k["partial"], k["signal"], k["exit_code"]) == (True, "SIGINT", 130)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_the_whole_process_group(tmp_path, sig):
    """A terminal's Ctrl-C (or a scheduler) signals every process of the group: the script sees it too."""
    proc, _ = recorded(tmp_path, new_session=True)
    os.killpg(proc.pid, sig)
    code, err = finish(proc)
    assert code == 128 + sig, err
    k = partial_key(tmp_path / "s.pickle")
    assert k["partial"] and k["signal"] == signal.Signals(sig).name


def test_a_scripts_own_sigterm_handler_is_left_alone(tmp_path):
    proc, _ = recorded(tmp_path, extra=["--own-handler"])
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc)
    assert code == 7, err  # its handler ran: sys.exit(7)
    k = partial_key(tmp_path / "s.pickle")
    assert k["partial"] is False and k["exit_code"] == 7


def test_sigterm_in_code_leaves_a_partial_file(tmp_path):
    proc, _ = start(tmp_path, [sys.executable, "loop.py"],
                    record="rec = __import__('tracekit').record('s.pickle', model=model, optimizer=opt); "
                           "rec.start()")
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc)
    assert code == -signal.SIGTERM, err  # it still dies of SIGTERM
    k = partial_key(tmp_path / "s.pickle")
    assert (k["partial"], k["signal"]) == (True, "SIGTERM")


@pytest.mark.parametrize("exc, partial", [(KeyboardInterrupt, True), (SystemExit, False)])
def test_keyboard_interrupt_and_exit_in_code_leave_a_file(tmp_path, exc, partial):
    import torch

    model = torch.nn.Linear(4, 2)
    with pytest.raises(exc):
        with tracekit.record(tmp_path / "k.pickle", model=model, backend="cpu"):
            model(torch.randn(3, 4)).sum().backward()
            raise exc()
    k = partial_key(tmp_path / "k.pickle")
    assert k["partial"] is partial and k["signal"] == ("SIGINT" if partial else None)
    assert k["error"].startswith(exc.__name__)


def test_a_second_sigterm_while_writing_does_not_lose_the_file(tmp_path):
    """SIGTERM to the process group reaches the script twice (directly, and passed on by `tracekit record`);
    the second one must not kill the process before the file is written."""
    from tracekit.record.signals import TermHandler

    seen = []

    def on_signal(signum):
        seen.append(signum)
        handler._handle(signum, None)  # the duplicate arrives while the file is being written
        seen.append("written")

    handler = TermHandler(on_signal)
    killed = []
    original_kill = os.kill
    try:
        os.kill = lambda pid, sig: killed.append(sig)
        handler._handle(signal.SIGTERM, None)
    finally:
        os.kill = original_kill
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert seen == [signal.SIGTERM, "written"] and killed == [signal.SIGTERM]


def test_a_duplicate_sigint_while_unwinding_is_the_same_ctrl_c():
    from tracekit.record.signals import same_interrupt

    with same_interrupt():
        signal.raise_signal(signal.SIGINT)  # would raise KeyboardInterrupt and abort the write
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
