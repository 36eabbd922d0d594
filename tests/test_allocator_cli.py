"""`tracekit whatif FILE --alloc-conf ...` and the report's `allocator` object, through the command line."""
import json
import subprocess
import sys

import pytest

from .conftest import ROOT, SAMPLES

CUDA = ROOT / "tests" / "fixtures" / "cuda"


def tk(*args):
    return subprocess.run([sys.executable, "-m", "tracekit.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def test_whatif_on_an_oom_recording():
    """samples/oom_cuda.pickle ran out of its 1 GiB cap asking for 512 MiB: the model under the recorded
    settings fails there too; with expandable segments it still would (553 MiB were allocated); under a
    1.2 GiB cap it would fit."""
    r = tk("whatif", SAMPLES / "oom_cuda.pickle", "--alloc-conf", "expandable_segments:True", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    d = out["devices"][0]
    assert out["whatif_settings"] == "expandable_segments:True" and out["recorded_settings"] == "defaults"
    assert d["memory_limit_bytes"] == 1 << 30
    assert d["recorded"] == {"peak_reserved_bytes": 603979776, "peak_allocated_bytes": 584328192, "exact": True}
    assert d["baseline"]["peak_reserved_bytes"] == 603979776
    assert d["oom"] == {"index": 209, "request_bytes": 512 << 20, "recorded": "failed", "baseline_fits": False,
                        "whatif_fits": False}
    assert d["whatif"]["segments_at_peak"] < d["baseline"]["segments_at_peak"]
    r = tk("whatif", SAMPLES / "oom_cuda.pickle", "--alloc-conf", "expandable_segments:True",
           "--memory-limit", "1200MiB")
    assert r.returncode == 0 and "would fit" in r.stdout


def test_whatif_text_all_settings():
    r = tk("whatif", CUDA / "qwen2_amp_adamw_b4_s256.pickle.gz", "--alloc-conf",
           "expandable_segments:True,max_split_size_mb:128,roundup_power2_divisions:4,garbage_collection_threshold:0.8")
    assert r.returncode == 0, r.stderr
    for want in ("peak reserved", "largest free block", "model, what if", "garbage_collection_threshold acts only"):
        assert want in r.stdout
    r = tk("whatif", CUDA / "qwen2_amp_adamw_b4_s256.pickle.gz", "--alloc-conf", "expandable_segments:True",
           "--start", "recorded", "--json")
    d = json.loads(r.stdout)["devices"][0]
    assert d["baseline"]["peak_reserved_bytes"] == d["recorded"]["peak_reserved_bytes"] == 1082130432


@pytest.mark.parametrize("args, says", [
    (["--alloc-conf", "nonsense:1"], "unknown setting 'nonsense'"),
    (["--alloc-conf", "max_split_size_mb:5"], "at least 20"),
    (["--alloc-conf", "expandable_segments:maybe"], "True or False"),
])
def test_whatif_bad_settings_are_one_line(args, says):
    r = tk("whatif", SAMPLES / "oom_cuda.pickle", *args)
    assert r.returncode == 2 and says in r.stderr and r.stderr.count("\n") == 1 and not r.stdout


def test_whatif_needs_a_budget_or_alloc_conf_and_one_file():
    r = tk("whatif", SAMPLES / "oom_cuda.pickle")
    assert r.returncode == 2 and "--budget" in r.stderr
    r = tk("whatif", SAMPLES / "oom_cuda.pickle", SAMPLES / "lora_cuda.pickle", "--alloc-conf",
           "expandable_segments:True")
    assert r.returncode == 2 and "one recording" in r.stderr
    r = tk("whatif", SAMPLES / "gpt_adamw.pickle", "--alloc-conf", "expandable_segments:True")
    assert r.returncode == 2 and "no caching allocator" in r.stderr and "Traceback" not in r.stderr


def test_report_json_has_the_allocator_object():
    r = tk("report", "--json", "--no-cache", CUDA / "qwen2_generate_b2_p256_n128.pickle.gz")
    d = json.loads(r.stdout)["devices"][0]
    a = d["allocator"]
    assert a["exact"] and a["why"] is None and a["settings"] == "defaults" and a["settings_recorded"]
    assert d["peak_allocated_block_bytes"] == a["peak_allocated_bytes"] == 173068288
    assert d["peak_reserved_bytes"] == a["peak_reserved_bytes"] == 184549376
