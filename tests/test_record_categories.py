"""A recorded file carries a "category" on its alloc/free entries, agreeing with tracekit's own categorize."""
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tracekit  # noqa: E402
from tracekit.analysis.categories import CATEGORIES, categorize  # noqa: E402
from tracekit.analysis.replay import replay  # noqa: E402
from tracekit.model import ALLOC  # noqa: E402


def test_recorded_entries_carry_categories(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(torch.randn(16, 32)), torch.randint(0, 4, (16,))).backward()
        optimizer.step()
    path = tracekit.record_steps(step, steps=2, warmup=0, path=str(tmp_path / "c.pickle"), model=model,
                                 optimizer=optimizer, backend="cpu")
    with open(path, "rb") as f:
        entries = pickle.load(f)["device_traces"][0]
    allocs = [e for e in entries if e["action"] == "alloc"]
    assert allocs and all(e.get("category") in CATEGORIES for e in allocs)
    assert all(e.get("category") in CATEGORIES for e in entries if e["action"] == "free_completed")
    assert {"gradient", "optimizer_state", "activation"} <= {e["category"] for e in entries
                                                                          if "category" in e}
    trace = tracekit.load(path)
    al = replay(trace)[0].allocations
    cats = categorize(trace)[0]
    names = cats.label_names()
    traced = al.alloc_index >= 0
    file_cats = np.array([entries[i]["category"] for i in al.alloc_index[traced]], dtype=object)
    assert len(file_cats) == len(allocs)
    assert (file_cats == names[traced]).all()
    freed = al.free_index >= 0
    assert all(entries[i]["category"] == n for i, n in zip(al.free_index[freed], names[freed]))
    assert trace.events.action[trace.events.device_slice(0)].tolist().count(ALLOC) == len(allocs)
