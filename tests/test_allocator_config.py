"""PYTORCH_CUDA_ALLOC_CONF parsing and the size rules, against the values torch's own code and tests give."""
import pytest

from tracekit.analysis.allocator.config import (DEFAULT, LARGE_BUFFER, MB, NO_LIMIT, ConfigError, _next_division,
                                                from_settings, parse_alloc_conf)
from tracekit.analysis.allocator.core import Allocator


def test_defaults():
    assert DEFAULT.max_split_size == NO_LIMIT and DEFAULT.max_non_split_rounding == LARGE_BUFFER
    assert DEFAULT.round_size(1) == 512 and DEFAULT.round_size(512) == 512 and DEFAULT.round_size(513) == 1024
    assert DEFAULT.round_size(1200) == 1536
    assert DEFAULT.describe() == "defaults"


def test_allocation_sizes():
    """2 MiB segments for the small pool, 20 MiB for 1-10 MiB requests, else rounded up to 2 MiB."""
    assert Allocator.allocation_size(512) == 2 * MB
    assert Allocator.allocation_size(MB) == 2 * MB
    assert Allocator.allocation_size(MB + 512) == 20 * MB
    assert Allocator.allocation_size(10 * MB - 512) == 20 * MB
    assert Allocator.allocation_size(10 * MB) == 10 * MB
    assert Allocator.allocation_size(10 * MB + 512) == 12 * MB


def test_power_of_two_divisions():
    """torch's own example: 1200 with 4 divisions between 1024 and 2048 rounds to 1280."""
    assert _next_division(1200, 4) == 1280
    assert _next_division(1024, 4) == 1024
    cfg = parse_alloc_conf("roundup_power2_divisions:4")
    assert cfg.round_size(1200) == 1536  # below 512 x divisions: plain 512 B rounding
    assert cfg.round_size(5 * MB + 1) == 6 * MB  # [4, 8) MiB in steps of 1 MiB
    assert cfg.round_size(9 * MB) == 10 * MB
    assert cfg.round_size(16 * MB) == 16 * MB


def test_division_list_as_torch_tests_read_it():
    """c10's AllocatorConfigTest: [64:8,128:2,256:4,512:2,1024:4,>:1] gives these per-size divisions."""
    cfg = parse_alloc_conf("roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]")
    want = {32: 8, 64: 8, 128: 2, 256: 4, 512: 2, 1024: 4, 2048: 1, 4096: 1}
    assert {mb: cfg.divisions(mb * MB) for mb in want} == want
    cfg = parse_alloc_conf("roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]")
    want = {64: 8, 128: 8, 256: 16, 512: 1, 1024: 0, 2048: 8, 4096: 2}
    assert {mb: cfg.divisions(mb * MB) for mb in want} == want


def test_combination_and_description():
    cfg = parse_alloc_conf("expandable_segments:True, max_split_size_mb:128,roundup_power2_divisions:4,"
                           "garbage_collection_threshold:0.8")
    assert cfg.expandable_segments and cfg.max_split_size == 128 * MB and cfg.garbage_collection_threshold == 0.8
    assert cfg.roundup_power2_divisions == (4,) * 16
    assert parse_alloc_conf(cfg.describe()) == parse_alloc_conf(cfg.describe())
    again = parse_alloc_conf(cfg.describe())
    assert (again.expandable_segments, again.max_split_size, again.roundup_power2_divisions,
            again.garbage_collection_threshold) == (True, 128 * MB, (4,) * 16, 0.8)
    assert parse_alloc_conf("release_lock_on_cudamalloc:True,pinned_num_register_threads:8,backend:native")


@pytest.mark.parametrize("text, says", [
    ("foo:1", "unknown setting 'foo'"),
    ("max_split_size_mb:10", "at least 20"),
    ("max_split_size_mb:abc", "whole number"),
    ("max_split_size_mb", "needs a value"),
    ("expandable_segments:yes", "True or False"),
    ("garbage_collection_threshold:1.5", "(0, 1)"),
    ("garbage_collection_threshold:x", "a number"),
    ("roundup_power2_divisions:3", "powers of 2"),
    ("roundup_power2_divisions:[256:3]", "powers of 2"),
    ("roundup_power2_divisions:[3:4]", "interval starts"),
    ("roundup_power2_divisions:[256:4", "closing"),
    ("backend:cudaMallocAsync", "does not model"),
    ("expandable_segments:True max_split_size_mb:30", "True or False"),
    (",", "expected a setting name"),
])
def test_refused(text, says):
    with pytest.raises(ConfigError) as e:
        parse_alloc_conf(text)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_from_recorded_settings():
    rec = {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": 134217728, "garbage_collection_threshold": 0.0,
           "expandable_segments": True,
           "roundup_power2_divisions": {str(1 << i): (4 if i >= 8 else 0) for i in range(16)}}
    cfg, notes = from_settings(rec)
    assert cfg.max_split_size == 128 * MB and cfg.expandable_segments and not notes
    assert cfg.divisions(MB) == 0 and cfg.divisions(256 * MB) == 4
    default = {"max_split_size": -1, "expandable_segments": False, "roundup_power2_divisions": {"1": 0}}
    assert from_settings(default)[0] == DEFAULT
    cfg, notes = from_settings(None)
    assert cfg == DEFAULT and "defaults" in notes[0]
