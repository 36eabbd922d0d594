"""`tracekit check`: exit 0 within budget, 1 over it (with a readable list), 2 on bad arguments or files."""
import json
import subprocess
import sys

import pytest

from tests.conftest import SAMPLES
from tests.oracle import naive_replay
from tracekit.io import read_document


def run(*args):
    p = subprocess.run([sys.executable, "-m", "tracekit.cli", "check", *map(str, args)],
                       capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def leak_loop():
    path = SAMPLES / "leak_loop.pickle"
    if not path.exists():
        pytest.skip(f"{path} is missing")
    snap, _ = read_document(str(path))
    return path, naive_replay(snap)["peak"]


def test_within_budget_exits_0(leak_loop):
    path, peak = leak_loop
    code, out, _ = run(path, "--max-peak", f"{peak}B", "--max", f"activation={peak}B")
    assert code == 0, out
    assert "within budget" in out


def test_over_budget_exits_1_and_lists_what(leak_loop):
    path, peak = leak_loop
    code, out, _ = run(path, "--max-peak", f"{peak - 1}B", "--max", "optimizer_state=1KiB", "--no-leaks")
    assert code == 1
    lines = [line for line in out.splitlines() if line.startswith("  - ")]
    assert len(lines) == 3
    assert "peak allocated" in lines[0] and "over by 1 B" in lines[0]
    assert "optimizer_state at the peak" in lines[1]
    assert "leak" in lines[2]


def test_json_output(leak_loop):
    path, peak = leak_loop
    code, out, _ = run(path, "--max-peak", "1KiB", "--json")
    assert code == 1
    got = json.loads(out)
    assert got["ok"] is False and got["problems"][0]["what"] == "peak"
    assert got["problems"][0]["bytes"] == peak and got["problems"][0]["limit"] == 1024


def test_clean_recording_passes_no_leaks():
    path = SAMPLES / "gpt_adamw.pickle"
    if not path.exists():
        pytest.skip(f"{path} is missing")
    assert run(path, "--no-leaks")[0] == 0


def test_rules_add_budgetable_categories(tmp_path, leak_loop):
    path, _ = leak_loop
    src = (SAMPLES / "make_samples.py").read_text().splitlines()
    start = next(i for i, t in enumerate(src) if t.startswith("def leak_loop"))
    line = next(i for i, t in enumerate(src) if i > start and "logits = model(inputs)" in t) + 1
    rules = tmp_path / "rules.toml"
    rules.write_text(f'[[rule]]\ncategory = "logits"\nfile = "make_samples\\\\.py$"\nline = {line}\nmin_size = "1MiB"\n')
    code, out, _ = run(path, "--rules", rules, "--max", "logits=1MiB")
    assert code == 1 and "logits at the peak" in out
    assert run(path, "--max", "logits=1MiB")[0] == 2  # unknown without the rules


@pytest.mark.parametrize("args,message", [
    (["--max-peak", "lots"], "not a size"),
    (["--max", "activation"], "CATEGORY=SIZE"),
    (["--max", "activaton=1GiB"], "unknown category"),
    (["--rules", "/nonexistent.toml"], "does not exist"),
])
def test_bad_arguments_exit_2(leak_loop, args, message):
    code, out, err = run(leak_loop[0], *args)
    assert code == 2
    assert message in err


def test_bad_files_exit_2(tmp_path):
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"not a snapshot")
    code, _, err = run(bad, "--max-peak", "1GiB")
    assert code == 2 and "cannot open" in err
    code, _, err = run(tmp_path / "missing.pickle")
    assert code == 2 and "no such file" in err
    rules = tmp_path / "r.toml"
    rules.write_text("[[rule]]\ncategory = 'x'\n")
    path = SAMPLES / "gpt_adamw.pickle"
    if path.exists():
        code, _, err = run(path, "--rules", rules)
        assert code == 2 and "at least one" in err


@pytest.mark.parametrize("value,message", [
    ("1e999", "larger than any memory"), ("1.5", "not a whole number of bytes"), ("-1", "not a size"),
    ("inf", "not a size"), ("nan", "not a size"), ("9" * 30, "larger than any memory"), ("1.5 XB", "not a size"),
    ("", "not a size"), ("80", "has no unit: give one of B, KiB, MiB, GiB"), ("1048576", "has no unit"), ("1e99999999999", "not a size"),
])
def test_budgets_that_are_not_sizes_are_one_line_exit_2(leak_loop, value, message):
    for args in (["--max-peak", value], ["--max-reserved", value], ["--max", f"activation={value}"]):
        code, out, err = run(leak_loop[0], *args)
        assert code == 2, (args, err)
        assert message in err and err.startswith("tracekit: --max") and err.count("\n") == 1, err
        assert "Traceback" not in err


def test_size_parsing_against_independent_arithmetic():
    from tracekit.units import parse_bytes

    cases = {"0": 0, "1048576": 2**20, "1e9": 10**9, "2GiB": 2 * 2**30, "1.5GiB": 3 * 2**29, "512 MB": 512 * 10**6,
             "0.5KiB": 512, "1.5kb": 1500, " 7 B ": 7, ".5MiB": 2**19, "9223372036854775807": 2**63 - 1,
             "3TiB": 3 * 2**40}
    for text, expected in cases.items():
        assert parse_bytes(text) == expected, text


def test_bom_json_and_fifo(tmp_path, leak_loop):
    from tracekit.io.unpickle import restricted_load

    snap = restricted_load(open(leak_loop[0], "rb"))
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(snap).encode())
    code, out, err = run(bom, "--max-peak", f"{leak_loop[1]}B")
    assert code == 0, err
    assert run(bom, "--max-peak", f"{leak_loop[1] - 1}B")[0] == 1
    fifo = tmp_path / "pipe.json"
    import os

    os.mkfifo(fifo)
    code, out, err = run(fifo, "--max-peak", "1GiB")
    assert code == 2 and "named pipe (FIFO)" in err and "empty" not in err
