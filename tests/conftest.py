"""Shared test setup: a private cache folder, the real fixtures, offscreen Qt."""
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT.parent / "shared" / "fixtures" / "real"
SAMPLES = ROOT / "samples"

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """Never read or write the user's real cache from tests."""
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "tracekit-cache"))


def fixture(name) -> Path:
    path = FIXTURES / name
    if not path.exists():
        pytest.skip(f"{path} is missing (../shared/fixtures/real beside the checkout)")
    return path
