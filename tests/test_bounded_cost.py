"""Issue 32: bounded cost for any input, never "this is a bug", a cache that never serves a wrong answer.

Each adversarial file (tests/adversarial.py) must be reported in a few seconds with exit 0 or 2 and one
line; the analyses made linear must give what the definitions they replace give."""
import contextlib
import io
import json
import os
import pickle
import random
import re
import time

import numpy as np
import pytest

import tracekit
from tracekit.cli import main
from tracekit.io import sources
from tracekit.io.cache import folder as cachefiles
from tracekit.io.cache import traces as cache
from tracekit.io.limits import MAX_NAME

from . import adversarial as adv
from .conftest import SAMPLES, fixture

LIMIT_S = 15  # the bound for one report of an adversarial file (each takes about 2 s here)


def run_cli(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:
            code = e.code
    return code or 0, out.getvalue(), err.getvalue()


def _report(tmp_path, name, snap, *extra):
    p = tmp_path / f"{name}.pickle"
    p.write_bytes(pickle.dumps(snap, protocol=4))
    t0 = time.monotonic()
    code, out, err = run_cli("report", p, "--json", "--no-cache", *extra)
    took = time.monotonic() - t0
    assert "Traceback" not in err and "this is a bug" not in err, err
    assert took < LIMIT_S, f"{name}: {took:.1f} s"
    return code, out, err


@pytest.fixture
def no_debug(monkeypatch):
    monkeypatch.delenv("TRACEKIT_DEBUG", raising=False)


# -- names: linear regexes, and long names cut at read time ------------------------------------------

# the patterns as they were (quadratic on a long run of word characters), and where they live now
OLD = {
    ("tracekit.analysis.sites", "_NODE"): r"(\w+Backward\d*)(::apply|_apply_functional)|(AccumulateGrad)",
    ("tracekit.analysis.frames", "_AUTOGRAD_NODE"): r"(\w+Backward\d*)(::apply|_apply_functional)|(AccumulateGrad)",
    ("tracekit.analysis.estimate.simulate", "_NODE"): r"(\w+Backward\d*)(?:::apply|_apply_functional)|(AccumulateGrad)",
    ("tracekit.analysis.phases", "_RE_BACKWARD_CPP"):
        r"torch::autograd::(Engine|PythonEngine|python::PythonEngine)::|\w+Backward\d*::apply"
        r"|\w+Backward\d*_apply_functional|validate_outputs|torch::autograd::PyNode::apply"
        r"|torch::autograd::CppNode|SavedVariable::unpack|call_function\(",
}


def _names():
    """Every frame name and file name of the real fixtures and samples, plus crafted near-misses."""
    out = set()
    for p in sorted(SAMPLES.glob("*.pickle"))[:6] + [fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle"),
                                                     fixture("snapshot_cpp_frames_adamw_full_step.pickle")]:
        t = tracekit.load(p, use_cache=False)
        out.update(t.strings[i] for i in np.unique(np.concatenate([t.frames.name, t.frames.filename])).tolist())
    rng = random.Random(32)
    parts = ["Add", "Backward", "0", "1", "::apply", "_apply_functional", "x", " ", ":", "AccumulateGrad", "_", "é",
             "torch::autograd::Engine::", "\n"]
    out.update("".join(rng.choice(parts) for _ in range(rng.randint(1, 8))) for _ in range(3000))
    return sorted(out)


def test_the_linear_patterns_match_what_the_old_ones_matched():
    import importlib

    names = _names()
    assert len(names) > 3000
    for (mod, attr), old in OLD.items():
        new, old = getattr(importlib.import_module(mod), attr), re.compile(old)
        for s in names:
            a, b = old.search(s), new.search(s)
            assert (a and (a.span(), a.groups())) == (b and (b.span(), b.groups())), (mod, attr, s[:80])


def test_kv_cache_file_test_matches_the_pattern():
    from tracekit.analysis.phases import _RE_KV_CACHE, _kv_cache_file

    rng = random.Random(7)
    parts = ["transformers", "/", "\\", "peft", "cache", "_utils", ".py", "\n", "a", "vllm", "x"]
    for s in [rng.choice(parts) for _ in range(0)] + ["".join(rng.choice(parts) for _ in range(rng.randint(1, 9)))
                                                      for _ in range(20000)]:
        assert _kv_cache_file(s) == bool(_RE_KV_CACHE.search(s)), s


@pytest.mark.parametrize("piece", adv.LONG_PIECES)
def test_every_pattern_is_linear_in_a_long_name(piece):
    """Each compiled pattern of the analysis on 100k characters of one repeated piece: milliseconds, where
    the quadratic ones took seconds (\\w+Backward: 2 s at 20k characters, 91 s at 100k through a report)."""
    import importlib

    text = piece * (adv.N // len(piece))
    for mod in ("phases", "frames", "sites", "libraries", "levers", "modtree", "modules", "estimate.simulate",
                "generation", "categories"):
        m = importlib.import_module(f"tracekit.analysis.{mod}")
        for name, rx in list(vars(m).items()) + [(f"_REVEALS[{i}]", p) for i, (p, _) in
                                                 enumerate(getattr(m, "_REVEALS", []))]:
            if isinstance(rx, re.Pattern):
                t0 = time.perf_counter()
                if name == "_RE_KV_CACHE":  # quadratic on its own: used only through _kv_cache_file, which is not
                    m._kv_cache_file(text + "cache.py")
                else:
                    rx.search(text)
                assert time.perf_counter() - t0 < 0.25, f"{mod}.{name} on {piece!r} x {len(text) // len(piece)}"


def test_long_names_are_cut_at_read_time_with_one_warning(tmp_path, no_debug):
    code, out, err = _report(tmp_path, "long", adv.long_names())
    assert code == 0
    lines = err.rsplit("\r", 1)[-1].splitlines()
    assert lines == [f"tracekit: warning: 40 frame names or file names longer than {MAX_NAME} characters were cut "
                     f"to {MAX_NAME}"]
    t = tracekit.load(tmp_path / "long.pickle", use_cache=False)
    used = {t.strings[i] for i in np.concatenate([t.frames.name, t.frames.filename]).tolist()}
    assert max(map(len, used)) == MAX_NAME + 3 and t.meta["names_cut"] == 40  # 4 long texts per piece
    assert json.loads(out)["names_cut"] == 40
    # the cached report says it too
    code, out2, err2 = run_cli("report", tmp_path / "long.pickle", "--json")
    code, out3, err3 = run_cli("report", tmp_path / "long.pickle", "--json")
    assert err3.rsplit("\r", 1)[-1] == err2.rsplit("\r", 1)[-1] == lines[0] + "\n" and out3 == out2


def test_many_distinct_long_names(tmp_path, no_debug):
    code, out, err = _report(tmp_path, "manylong", adv.many_long_names())
    assert code == 0 and "400 frame names" in err


# -- modules from stacks: linear alignment, no recursion, one parse per file ---------------------------

def _reference_align(node, o, lo, hi):
    from tracekit.analysis import modtree as mt

    calls = {ln for ln in o.calls if lo <= ln <= hi}
    callers = {line for line, _ in node.children}
    best = None
    for d in range(mt.MAX_SHIFT + 1):
        for shift in ((0,) if d == 0 else (-d, d)):
            c = _reference_cost(node.lines, callers, calls, lo, hi, shift)
            if best is None or c < best[1]:
                best = (shift, c)
        if best[1] == 0:
            break
    return best


def test_align_equals_the_shift_by_shift_definition():
    from tracekit.analysis import modtree as mt

    rng = random.Random(5)
    for _ in range(400):
        lo = rng.randint(1, 400)
        hi = lo + rng.randint(0, 200)
        o = sources.Outline(path="x", calls={rng.randint(1, 700): [("a", False)] for _ in range(rng.randint(0, 15))})
        node = mt.Node(parent=-1, caller_line=-1, file="f")
        node.lines = {rng.randint(-50, 800) for _ in range(rng.randint(1, 40))}
        for ln in rng.sample(sorted(node.lines), rng.randint(0, len(node.lines))):
            node.children[(ln, "g")] = 1
        assert mt._align(node, o, lo, hi) == _reference_align(node, o, lo, hi)


def test_align_on_50k_lines_and_52_forwards_is_fast():
    from tracekit.analysis import modtree as mt

    node = mt.Node(parent=-1, caller_line=-1, file="f")
    node.lines = set(range(1, 50_001))
    node.children = {(ln, "g"): 1 for ln in range(1, 50_001, 3)}
    o = sources.Outline(path="x", calls={ln: [("a", False)] for ln in range(1, 50_001, 7)})
    t0 = time.perf_counter()
    got = [mt._align(node, o, k * 900, k * 900 + 800) for k in range(52)]
    assert time.perf_counter() - t0 < 5  # 0.5 s here; shift by shift it took minutes
    small = mt.Node(parent=-1, caller_line=-1, file="f")  # the same answer as the definition on a slice
    small.lines = {ln for ln in node.lines if ln < 2000}
    small.children = {k: v for k, v in node.children.items() if k[0] < 2000}
    assert mt._align(small, o, 900, 1700) == _reference_align(small, o, 900, 1700)
    assert got[1][1] == _reference_cost(node.lines, {ln for ln, _ in node.children}, {ln for ln in o.calls
                                                                               if 900 <= ln <= 1700}, 900, 1700, got[1][0])


@pytest.mark.parametrize("in_source", [False, True])
def test_1200_nested_forwards(tmp_path, no_debug, in_source):
    src = tmp_path / "model.py"
    src.write_text(adv.model_source())
    code, out, err = _report(tmp_path, "deep", adv.deep_forwards(filename=str(src) if in_source else "/none/m.py"))
    assert code == 0, err
    assert json.loads(out)["devices"][0]["peak_allocated_bytes"] == (1 + 2 + 3) * adv.MiB  # all three live at once


def test_50k_line_numbers_in_a_real_source(tmp_path, no_debug):
    src = tmp_path / "model.py"
    src.write_text(adv.model_source())
    code, out, err = _report(tmp_path, "lines", adv.many_lines(str(src)))
    assert code == 0, err


def test_one_parse_per_real_file_however_it_is_spelled(tmp_path, no_debug, monkeypatch):
    src = tmp_path / "model.py"
    src.write_text(adv.model_source())
    sources._OUTLINES.clear()
    parsed = []
    real = sources._parse
    monkeypatch.setattr(sources, "_parse", lambda path, size: parsed.append(path) or real(path, size))
    code, out, err = _report(tmp_path, "spell", adv.many_spellings(str(src)))
    assert code == 0, err
    assert len(parsed) == 1  # 3000 spellings, one file


def test_a_source_over_the_limit_is_not_read(tmp_path, monkeypatch):
    big = tmp_path / "big.py"
    big.write_text("x = 1\n" * (sources.MAX_SOURCE_BYTES // 6 + 1))
    small = tmp_path / "small.py"
    small.write_text("class A:\n    def forward(self, x):\n        return self.b(x)\n")
    monkeypatch.setattr(sources, "open", lambda *a, **k: pytest.fail("opened a file over the limit"), raising=False)
    assert sources.outline(str(big)) is None
    monkeypatch.undo()
    assert sources.outline(str(small)).forwards() == [(2, 3, "A")]


def test_odd_line_numbers(tmp_path, no_debug):
    code, out, err = _report(tmp_path, "odd", adv.odd_lines())
    assert code == 0, err


# -- a device with segments but no trace entries ------------------------------------------------------

@pytest.mark.parametrize("name", ["oom_cuda.pickle", "gpt_adamw_cuda.pickle", "lora_cuda.pickle"])
def test_a_device_without_trace_entries(tmp_path, no_debug, name):
    from tracekit.io.reading import read_document

    snap, _ = read_document(SAMPLES / name)
    code, out, err = _report(tmp_path, "dev1", adv.device_without_entries(snap))
    assert code == 0, err
    code0, out0, _ = run_cli("report", SAMPLES / name, "--json", "--no-cache")
    got, alone = json.loads(out), json.loads(out0)
    assert [d["device"] for d in got["devices"]][:1] == [0]
    assert got["devices"][0]["peak_allocated_bytes"] == alone["devices"][0]["peak_allocated_bytes"]


# -- estimate --config -----------------------------------------------------------------------------------

BASE_CONFIG = fixture("../configs/gemma-2b.json") if os.path.exists(fixture("../configs/gemma-2b.json")) else None


def _config(tmp_path, text):
    p = tmp_path / "config.json"
    p.write_text(text)
    return p


def _base():
    from .conftest import ROOT

    return json.loads((ROOT / "tests/fixtures/configs/gemma-2b.json").read_text())


BAD_CONFIGS = [
    ("NaN", lambda b: json.dumps(b).replace('"hidden_size": 2048', '"hidden_size": NaN'), "NaN is not a value"),
    ("Infinity", lambda b: json.dumps(b).replace('"hidden_size": 2048', '"hidden_size": Infinity'), "Infinity"),
    ("1e400", lambda b: json.dumps(b).replace('"hidden_size": 2048', '"hidden_size": 1e400'), "too large"),
    ("5000 digits", lambda b: json.dumps(b).replace('"hidden_size": 2048', '"hidden_size": ' + "9" * 5000),
     "5000 digits"),
    ("deep", lambda b: json.dumps(b)[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ("list model_type", lambda b: json.dumps({**b, "model_type": ["llama"]}), "model_type must be a string"),
    ("kv heads 0", lambda b: json.dumps({**b, "num_key_value_heads": 0}), "at least one key/value head"),
    ("100k layers", lambda b: json.dumps({**b, "num_hidden_layers": 100_000}), "num_hidden_layers is 100,000"),
    ("vocab 1e12", lambda b: json.dumps({**b, "vocab_size": 10**12}), "vocab_size is 1,000,000,000,000"),
    ("ffn 1e15", lambda b: json.dumps({**b, "intermediate_size": 10**15}), "intermediate_size is"),
    ("negative", lambda b: json.dumps({**b, "num_attention_heads": -4}), "cannot be negative"),
    ("nested size", lambda b: json.dumps({**b, "text_config": {"vocab_size": 10**12}}), "text_config.vocab_size"),
    ("weight", lambda b: json.dumps({**b, "hidden_size": 1 << 20, "vocab_size": 1 << 24}), "one weight of"),
    ("a list", lambda b: "[1, 2]", "must be a JSON object"),
]


@pytest.mark.parametrize("label, make, says", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_bad_configs_are_one_line(tmp_path, no_debug, label, make, says):
    from tracekit.analysis.estimate.presets import read_config
    from tracekit.errors import TracekitError

    p = _config(tmp_path, make(_base()))
    with pytest.raises(TracekitError) as e:  # the one reader both the formula and --simulate use
        read_config(str(p))
    assert says in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 300
    t0 = time.monotonic()
    code, out, err = run_cli("estimate", "--config", p, "--batch", "1", "--seq", "128")
    assert (code, err.count("\n")) == (2, 1) and says in err and "bug" not in err, err
    assert time.monotonic() - t0 < 10


def test_simulate_refuses_absurd_sizes_in_one_line(tmp_path, no_debug):
    p = _config(tmp_path, json.dumps({**_base(), "vocab_size": 10**12}))
    code, out, err = run_cli("estimate", "--config", p, "--batch", "1", "--seq", "128", "--precision", "amp",
                             "--simulate")
    assert code == 2 and err.count("\n") == 1 and "vocab_size is 1,000,000,000,000" in err, err


def test_every_bundled_config_and_preset_passes_the_checks():
    from tracekit.analysis.estimate.presets import preset_names, read_config

    from .conftest import ROOT

    files = sorted((ROOT / "tests/fixtures/configs").glob("*.json"))
    assert len(files) > 20
    for f in files:
        assert read_config(str(f)) == json.loads(f.read_text())
    for name in preset_names():
        assert read_config(name)


# -- the cache: any damage is a miss, and the entry is written again ----------------------------------

@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(d))
    return d


def _entry_of(path):
    return cachefiles._file(cachefiles.key_for(str(path), os.stat(path)))


@pytest.mark.parametrize("column", ["ev_time_us", "ev_addr", "ev_size", "ev_stack_id"])
def test_a_byte_damaged_in_the_middle_of_a_column(tmp_path, cache_dir, no_debug, column):
    """The case the issue saw (a time of +9143974069278.5 s, IndexError 2147483648): now a miss, the file read
    afresh, the entry rewritten, the report that of --no-cache."""
    p = tmp_path / "s.pickle"
    stacks = [[adv.frame("/home/u/train.py", 10 + i % 300, "step")] for i in range(12_000)]
    p.write_bytes(pickle.dumps(adv.snapshot_with_stacks(stacks, sizes=[512 * (1 + i % 9) for i in range(12_000)])))
    fresh = run_cli("report", p, "--json", "--no-cache")
    tracekit.load(p)  # the trace's entry only (no stored report: the report below is computed from the trace)
    entry = _entry_of(p)
    raw = open(entry, "rb").read()
    magic, n, _ = cache._PRE.unpack(raw[:cache._PRE.size])
    dtype, count, offset = json.loads(raw[cache._PRE.size:cache._PRE.size + n])["columns"][column][:3]
    nbytes = count * np.dtype(dtype).itemsize
    assert 2 * 65536 < nbytes, nbytes  # the middle is outside the 64 KiB at each end that the old check read
    pos = cache._start(n) + offset + nbytes // 2  # one byte in the middle of the column
    with open(entry, "r+b") as f:
        f.seek(pos)
        f.write(bytes([raw[pos] ^ 0x40]))
    assert run_cli("report", p, "--json") == fresh
    assert cache.read(cachefiles.key_for(str(p), os.stat(p)), str(p)) is not None  # repaired: a hit again
    assert open(entry, "rb").read() == raw  # written again as it was before the damage


def test_a_damaged_column_is_seen_by_its_checksum(tmp_path):
    rng = np.random.default_rng(1)
    for n in (1, 7, 4096, 4099, 100_000):
        a = rng.integers(0, 2**40, n, dtype=np.int64)
        good = cache.column_sum(memoryview(a).cast("B"))
        raw = bytearray(memoryview(a).cast("B"))
        for pos in {0, len(raw) // 2, len(raw) - 1}:
            for bit in (0x01, 0x80):
                bad = bytearray(raw)
                bad[pos] ^= bit
                assert cache.column_sum(bad) != good, (n, pos, bit)
        if n >= 3 * 512:  # two 4 KiB pages swapped, a page zeroed
            w = a.copy()
            w[:512], w[512:1024] = a[512:1024], a[:512]
            assert cache.column_sum(memoryview(w).cast("B")) != good
            w = a.copy()
            w[512:1024] = 0
            assert cache.column_sum(memoryview(w).cast("B")) != good


def test_a_damaged_stored_report_is_computed_again(tmp_path, cache_dir, no_debug):
    import shutil

    p = tmp_path / "s.pickle"
    shutil.copy(fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle"), p)
    code, first, _ = run_cli("report", p, "--json")
    (stored,) = cache_dir.glob("*-*.json")
    data = bytearray(stored.read_bytes())
    i = data.index(b'"peak_allocated_bytes": ') + len(b'"peak_allocated_bytes": ')
    data[i] = ord("9") if data[i] != ord("9") else ord("8")  # a digit of the peak: still valid JSON
    stored.write_bytes(bytes(data))
    code, again, _ = run_cli("report", p, "--json")
    assert again == first
    doc = json.loads(stored.read_text())  # rewritten, with a CRC that matches
    assert doc["crc"] == cachefiles.value_crc(doc["value"])


# -- --alloc-conf as torch reads it -------------------------------------------------------------------

WHOLE = ["1_000", "\u0661\u0660\u0660", "\uff13\uff10", "99999999999999999999", "18446744073709551615",
         "18446744073709551616", "-30", "+30", "30abc", "0x30", "0030", "abc", "20", "19", "21", "-0", "1e3", "4", "3",
         "0", "1", "256", "-18446744073709551615", "0" * 50 + "64", "9" * 5000]
FRACTIONS = ["1e-320", "2.2250738585072014e-308", "2.225073858507201e-308", "1e-308", "0.5", ".5", "5.", "0x0.8p0",
             "0x1p-1", "0x1p-1070", "0x1.1p-1070", "0x1p99999", "0x1p-99999", "nan", "NaN", "inf", "-inf", "INFINITY", "0.5x", "0.5e", "e5", "-0.5",
             "1", "0.9999999999999999", "0.99999999999999995", "0", "1e-400", "x", "0x", "0x.8", "+0.25", "1e309"]
CASES = [f"{k}:{v}" for k in ("max_split_size_mb", "max_non_split_rounding_mb", "roundup_power2_divisions")
         for v in WHOLE] + [f"garbage_collection_threshold:{v}" for v in FRACTIONS + WHOLE] + \
    ["max_split_size_mb:\t30", "max_split_size_mb:30\n", "roundup_power2_divisions:[256:1_0,>:4]",
     "roundup_power2_divisions:[3:1]", "roundup_power2_divisions:[-256:1]", "roundup_power2_divisions:[256:3]",
     "roundup_power2_divisions:[1_024:2,>:8]"]
# torch 2.13's answers (test_alloc_conf_agrees_with_the_installed_torch checks them against the installed torch
# when it is importable): the settings it refuses
TORCH_REFUSES = {  # made by asking torch 2.13.0+cpu's parser about each of CASES
    'garbage_collection_threshold:0x1p99999',
    'garbage_collection_threshold:0x1p-99999',
    'max_split_size_mb:1_000',
    'max_split_size_mb:\u0661\u0660\u0660',
    'max_split_size_mb:\uff13\uff10',
    'max_split_size_mb:99999999999999999999',
    'max_split_size_mb:18446744073709551616',
    'max_split_size_mb:0x30',
    'max_split_size_mb:abc',
    'max_split_size_mb:19',
    'max_split_size_mb:-0',
    'max_split_size_mb:1e3',
    'max_split_size_mb:4',
    'max_split_size_mb:3',
    'max_split_size_mb:0',
    'max_split_size_mb:1',
    'max_split_size_mb:-18446744073709551615',
    "max_split_size_mb:" + "9" * 5000,
    'max_non_split_rounding_mb:1_000',
    'max_non_split_rounding_mb:\u0661\u0660\u0660',
    'max_non_split_rounding_mb:\uff13\uff10',
    'max_non_split_rounding_mb:99999999999999999999',
    'max_non_split_rounding_mb:18446744073709551616',
    'max_non_split_rounding_mb:0x30',
    'max_non_split_rounding_mb:abc',
    'max_non_split_rounding_mb:19',
    'max_non_split_rounding_mb:-0',
    'max_non_split_rounding_mb:1e3',
    'max_non_split_rounding_mb:4',
    'max_non_split_rounding_mb:3',
    'max_non_split_rounding_mb:0',
    'max_non_split_rounding_mb:1',
    'max_non_split_rounding_mb:-18446744073709551615',
    "max_non_split_rounding_mb:" + "9" * 5000,
    'roundup_power2_divisions:\u0661\u0660\u0660',
    'roundup_power2_divisions:\uff13\uff10',
    'roundup_power2_divisions:99999999999999999999',
    'roundup_power2_divisions:18446744073709551615',
    'roundup_power2_divisions:18446744073709551616',
    'roundup_power2_divisions:-30',
    'roundup_power2_divisions:+30',
    'roundup_power2_divisions:30abc',
    'roundup_power2_divisions:0x30',
    'roundup_power2_divisions:0030',
    'roundup_power2_divisions:abc',
    'roundup_power2_divisions:20',
    'roundup_power2_divisions:19',
    'roundup_power2_divisions:21',
    'roundup_power2_divisions:-0',
    'roundup_power2_divisions:3',
    'roundup_power2_divisions:0',
    "roundup_power2_divisions:" + "9" * 5000,
    'garbage_collection_threshold:1e-320',
    'garbage_collection_threshold:2.225073858507201e-308',
    'garbage_collection_threshold:1e-308',
    'garbage_collection_threshold:5.',
    'garbage_collection_threshold:nan',
    'garbage_collection_threshold:NaN',
    'garbage_collection_threshold:inf',
    'garbage_collection_threshold:-inf',
    'garbage_collection_threshold:INFINITY',
    'garbage_collection_threshold:e5',
    'garbage_collection_threshold:-0.5',
    'garbage_collection_threshold:1',
    'garbage_collection_threshold:0.99999999999999995',
    'garbage_collection_threshold:0',
    'garbage_collection_threshold:1e-400',
    'garbage_collection_threshold:x',
    'garbage_collection_threshold:0x',
    'garbage_collection_threshold:1e309',
    'garbage_collection_threshold:1_000',
    'garbage_collection_threshold:\u0661\u0660\u0660',
    'garbage_collection_threshold:\uff13\uff10',
    'garbage_collection_threshold:99999999999999999999',
    'garbage_collection_threshold:18446744073709551615',
    'garbage_collection_threshold:18446744073709551616',
    'garbage_collection_threshold:-30',
    'garbage_collection_threshold:+30',
    'garbage_collection_threshold:30abc',
    'garbage_collection_threshold:0x30',
    'garbage_collection_threshold:0030',
    'garbage_collection_threshold:abc',
    'garbage_collection_threshold:20',
    'garbage_collection_threshold:19',
    'garbage_collection_threshold:21',
    'garbage_collection_threshold:-0',
    'garbage_collection_threshold:1e3',
    'garbage_collection_threshold:4',
    'garbage_collection_threshold:3',
    'garbage_collection_threshold:0',
    'garbage_collection_threshold:1',
    'garbage_collection_threshold:256',
    'garbage_collection_threshold:-18446744073709551615',
    'garbage_collection_threshold:0000000000000000000000000000000000000000000000000064',
    "garbage_collection_threshold:" + "9" * 5000,
    'roundup_power2_divisions:[3:1]',
    'roundup_power2_divisions:[-256:1]',
    'roundup_power2_divisions:[256:3]',
}


def _ours(text):
    from tracekit.analysis.allocator.config import ConfigError, parse_alloc_conf

    try:
        parse_alloc_conf(text)
        return True
    except ConfigError as e:
        assert "\n" not in str(e) and len(str(e)) < 400, str(e)[:500]
        return False


def test_alloc_conf_reads_numbers_as_torch_does():
    wrong = [t[:60] for t in CASES if _ours(t) == (t in TORCH_REFUSES)]
    assert not wrong, wrong
    from tracekit.analysis.allocator.config import MB, parse_alloc_conf

    assert parse_alloc_conf("max_split_size_mb:30abc").max_split_size == 30 * MB
    assert parse_alloc_conf("max_split_size_mb:-30").max_split_size == (2**64 - 1) // MB * MB  # wraps, then capped
    assert parse_alloc_conf("roundup_power2_divisions:1_000").roundup_power2_divisions == (1,) * 16
    assert parse_alloc_conf("garbage_collection_threshold:0x1p-1").garbage_collection_threshold == 0.5


def test_alloc_conf_agrees_with_the_installed_torch():
    torch = pytest.importorskip("torch")
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        pytest.skip("this torch has no _accelerator_setAllocatorSettings")

    def theirs(text):
        try:
            setter(text)
            return True
        except Exception:
            return False
        finally:
            setter("")

    wrong = [t[:60] for t in CASES if theirs(t) != _ours(t)]
    assert not wrong, wrong
    assert {t for t in CASES if not theirs(t)} == TORCH_REFUSES  # the table above is this torch's


def test_a_long_bad_setting_is_shown_cut():
    from tracekit.analysis.allocator.config import ConfigError, parse_alloc_conf

    for text in ("max_split_size_mb:" + "x" * 120_000, "x" * 120_000 + ":1", "expandable_segments:" + "y" * 120_000,
                 "garbage_collection_threshold:" + "z" * 120_000):
        with pytest.raises(ConfigError) as e:
            parse_alloc_conf(text)
        assert len(str(e.value)) < 400 and "120,00" in str(e.value), str(e.value)[:400]


@pytest.mark.parametrize("flags, says", [
    (["--layers", "100000"], "--layers is 100,000"),
    (["--vocab", str(10**12)], "--vocab is 1,000,000,000,000"),
    (["--kv-heads", "0"], "--kv-heads is 0"),
    (["--ffn", str(10**15)], "--ffn is 1,000,000,000,000,000"),
])
def test_shape_flags_have_the_config_bounds(no_debug, flags, says):
    base = {"--hidden": "4096", "--layers": "32", "--heads": "32", "--vocab": "32000"}
    base.update(dict(zip(flags[::2], flags[1::2])))
    code, out, err = run_cli("estimate", *[x for kv in base.items() for x in kv], "--batch", "1", "--seq", "128")
    assert (code, err.count("\n")) == (2, 1) and says in err, err
    base.update({"--layers": "32", "--vocab": "32000", "--kv-heads": "8"})
    base.pop("--ffn", None)
    assert run_cli("estimate", *[x for kv in base.items() for x in kv], "--batch", "1", "--seq", "128")[0] == 0


@pytest.mark.parametrize("args", [["report", "FILE", "--last"], ["report", "FILE", "--from"], ["estimate", "--params"],
                                  ["check", "FILE", "--max-peak"], ["whatif", "FILE", "--alloc-conf"]])
def test_a_120_kb_bad_value_is_not_echoed_whole(no_debug, args):
    value = "9x" * 60_000
    code, out, err = run_cli(*[str(SAMPLES / "oom_cuda.pickle") if a == "FILE" else a for a in args], value)
    assert code == 2 and len(err) < 1200, (code, len(err), err[:300])


def test_one_analysis_parses_a_bounded_amount_of_source(tmp_path, monkeypatch):
    """Frames may name every library file on the machine: one module tree parses at most MAX_PARSED_BYTES
    of them (each file at most once), the rest are as if absent."""
    from tracekit.analysis.modtree import stack_modules

    text = adv.model_source(classes=4, body=10)
    files = []
    for i in range(40):
        f = tmp_path / f"m{i}.py"
        f.write_text(text + "#" * 200_000 + "\n")  # 200 KB each: 8 MB in all
        files.append(str(f))
    monkeypatch.setattr(sources, "MAX_PARSED_BYTES", 1_000_000)
    sources._OUTLINES.clear()
    parsed = []
    real = sources._parse
    monkeypatch.setattr(sources, "_parse", lambda path, size: parsed.append(size) or real(path, size))
    stacks = [[adv.frame(f, 5, "forward"), adv.frame("/home/u/train.py", 5, "step")] for f in files]
    p = tmp_path / "many.pickle"
    p.write_bytes(pickle.dumps(adv.snapshot_with_stacks(stacks), protocol=4))
    sm = stack_modules(tracekit.load(p, use_cache=False))
    assert len(parsed) == 1_000_000 // os.path.getsize(files[0]) == 4  # then the budget is spent
    named = [n for n in sm.nodes if n.cls]
    assert len(named) == 4 and all(n.name == "M0" for n in named)  # line 5 is in M0.forward
    assert sources._left[0] is None  # the budget ends with the analysis


def _reference_cost(lines, callers, calls, lo, hi, shift):
    """How far the recorded lines land from where they should, shifted by `shift`: a caller line from the
    nearest line that calls a module, any line from the function's range. (modtree._align computes it
    for all shifts at once; this is the definition it is checked against.)"""
    cost = 0
    for ln in lines:
        x = ln + shift
        if x < lo or x > hi:
            cost += 10 + min(abs(x - lo), abs(x - hi))
        elif ln in callers and x not in calls:
            cost += 1 + min((abs(x - c) for c in calls), default=10)
    return cost
