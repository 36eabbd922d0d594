"""The pytest plugin (entry point `pytest11`): limit_peak_memory, no_memory_leaks, --tracekit-dir, run by pytester."""
import pickle
import re

import pytest

pytest_plugins = ["pytester"]
pytest.importorskip("torch")

BODY = '''
import pytest
import torch

KEEP = []


@pytest.mark.limit_peak_memory("64 MiB", device="cpu")
def test_small():
    x = torch.ones(1024, 1024)          # 4 MiB
    y = x * 2
    assert float(y.sum()) == 2 * 1024 * 1024


@pytest.mark.limit_peak_memory("16 MiB", device="cpu")
def test_big():
    a = torch.ones(2048, 2048)          # 16 MiB
    b = a + 1                           # +16 MiB: 32 MiB at the peak
    assert b.shape == (2048, 2048)


@pytest.mark.limit_peak_memory("4 MiB", device="cpu", category="input")
def test_category_within():
    a = torch.ones(2048, 2048)
    del a


@pytest.mark.limit_peak_memory("8 MiB", device="cpu", category="temporary")
def test_category_over():
    a = torch.ones(2048, 2048)          # a 16 MiB temporary
    del a


@pytest.mark.no_memory_leaks(iterations=5)
def test_clean_step():
    x = torch.randn(256, 256)
    (x @ x).sum()


@pytest.mark.no_memory_leaks(iterations=5, device="cpu")
def test_leaky_step():
    KEEP.append(torch.randn(512, 512) * 2)   # 1 MiB kept every call


@pytest.mark.limit_peak_memory("1 GiB", device="cuda")
def test_needs_cuda():
    pass
'''


def test_plugin_passes_fails_and_keeps_files(pytester, tmp_path):
    pytester.makepyfile(test_mem=BODY)
    keep = tmp_path / "kept"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", f"--tracekit-dir={keep}")
    outcomes = result.parseoutcomes()
    import torch

    cuda = torch.cuda.is_available()
    assert outcomes.get("passed") == 3 + cuda and outcomes.get("failed") == 3, result.stdout.str()
    assert outcomes.get("skipped", 0) == (0 if cuda else 1)
    out = result.stdout.str()
    # the big test's explanation: the figure, the limit and the line that allocates
    assert "FAILED test_mem.py::test_big" in out and "FAILED test_mem.py::test_leaky_step" in out
    assert "cpu: peak allocated 32.0 MiB > 16.0 MiB" in out
    assert "cpu: temporary peaked at 16.0 MiB > 8.0 MiB" in out
    assert "live at the peak, by allocation site:" in out
    assert re.search(r"16\.0 MiB .*test_mem\.py:\d+ in test_big", out)
    assert re.search(r"leak: memory grows by about 1\.0 MiB per iteration.*test_mem\.py:\d+ in test_leaky_step", out)
    kept = sorted(p.name for p in keep.iterdir())
    assert kept == ["test_mem.py_test_big.pickle", "test_mem.py_test_category_over.pickle",
                    "test_mem.py_test_leaky_step.pickle"]
    snap = pickle.loads((keep / "test_mem.py_test_leaky_step.pickle").read_bytes())
    assert len(snap["tracekit"]["iterations"]) == 5


def test_plugin_rejects_bad_markers(pytester):
    pytester.makepyfile(test_bad='''
import pytest

@pytest.mark.limit_peak_memory("lots")
def test_a():
    pass
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret != 0
    assert "is not a size" in result.stderr.str() + result.stdout.str()


def test_pytest_plugin_fails_a_test_that_runs_out_of_memory(pytester):
    pytester.makepyfile('''
import pytest
import torch


@pytest.mark.limit_peak_memory("1 TiB", device="cpu")
def test_oom():
    x = torch.ones(256, 256)
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total capacity "
                                      "of 79.18 GiB of which 1.00 GiB is free.")


@pytest.mark.limit_peak_memory("1 TiB", device="cpu")
def test_fine():
    torch.ones(256, 256)
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    text = result.stdout.str()
    assert "out of memory" in text and "asked for 3.0 GiB" in text and "1.0 GiB was free" in text


BUILDS_ITS_MODEL = '''
import pytest
import torch


@pytest.mark.no_memory_leaks(iterations=5)
def test_builds_its_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 256), torch.randint(0, 10, (32,))
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
'''


def test_no_memory_leaks_on_a_test_that_builds_its_model(pytester):
    """Each call builds and drops its own model and optimizer: the recorder must not keep them (it did,
    ~600 KiB per iteration, reported as the test's leak)."""
    pytester.makepyfile(test_build=BUILDS_ITS_MODEL)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA")
    assert result.parseoutcomes().get("passed") == 1, result.stdout.str()
