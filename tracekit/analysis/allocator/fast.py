"""The replay of a trace through the allocator model: compiled when the extension is built, else Python."""
from __future__ import annotations

from .exact import replay_allocator as _python


def replay_allocator(trace, device, config=None):
    return _python(trace, device, config)
