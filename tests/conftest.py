"""Shared test setup: a private cache folder, the real fixtures, offscreen Qt."""
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Real third-party fixtures live in the repository with their licences (tests/fixtures/real/SOURCES.md).
FIXTURES = ROOT / "tests" / "fixtures" / "real"
SAMPLES = ROOT / "samples"

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


@pytest.fixture(autouse=True)
def _cpu_recordings_unless_cuda(request, monkeypatch):
    """Tests record CPU training; on a GPU machine "auto" would pick CUDA for scripts (tests marked cuda excepted)."""
    if request.node.get_closest_marker("cuda") is None:
        monkeypatch.setenv("TRACEKIT_BACKEND", "cpu")
    else:
        monkeypatch.delenv("TRACEKIT_BACKEND", raising=False)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """Never read or write the user's real cache from tests."""
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "tracekit-cache"))


def fixture(name) -> Path:
    path = FIXTURES / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: the real fixtures ship with the repository")
    return path
