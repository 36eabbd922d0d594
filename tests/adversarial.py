"""Valid snapshots whose values cost: long names, deep or wide module chains, odd line numbers, devices
without trace entries. Each is a dict a PyTorch snapshot could hold (tests/synth.py's Sim underneath);
test_bounded_cost.py and test_fuzz.py feed them to the CLI."""
from .synth import MiB, Sim

N = 100_000  # characters of one long name (the case: 91 s before the regexes were made linear)
LONG_PIECES = ["a", "aBackward1", "Backward", "THPVariable_", "at::_ops::", "transformers/", "/site-packages/",
               "torch/nn/modules/", "-1", "_foreach_"]


def frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


def snapshot_with_stacks(stacks, sizes=None):
    """A snapshot whose allocations carry `stacks` (one each), half of them freed."""
    sim = Sim()
    addrs = []
    for i, frames in enumerate(stacks):
        addrs.append(sim.alloc((sizes[i] if sizes else (i % 7 + 1) * MiB), frames=frames))
    for a in addrs[::2]:
        sim.free(a)
    return sim.snapshot()


def long_names(n=N):
    """One allocation per kind of long name: as the frame's name, as its file name, and inside a C++ frame."""
    stacks = []
    for piece in LONG_PIECES:
        text = piece * (n // len(piece))
        stacks.append([frame("??", 0, text + "::apply"), frame("/home/u/train.py", 7, "step")])
        stacks.append([frame(text + ".py", 3, "forward"), frame("/home/u/train.py", 8, "step")])
        stacks.append([frame("/x/site-packages/" + text + "/cache_utils.py", 3, text), frame("/home/u/t.py", 9, "f")])
    return snapshot_with_stacks(stacks)


def many_long_names(count=200, n=20_000):
    """Many distinct long names (a few MB): the cost per name must stay bounded, not only the longest one's."""
    stacks = [[frame("??", 0, f"{i}" + "aBackward1" * (n // 10)), frame(f"/home/u/{i}" + "x/" * (n // 2) + ".py", i,
                                                                            "forward")] for i in range(count)]
    return snapshot_with_stacks(stacks)


def deep_forwards(depth=1200, filename="/nonexistent/model.py"):
    """One stack of `depth` nested forward frames (a recursive module): once a RecursionError."""
    inner = [frame(filename, 10 + (i % 50), "forward") for i in range(depth)]
    return snapshot_with_stacks([inner + [frame("/home/u/train.py", 5, "step")]] * 3)


def model_source(classes=52, body=20):
    """A Python file with `classes` nn.Module-like classes, each with a forward of `body` lines calling a child."""
    lines = []
    for c in range(classes):
        lines += [f"class M{c}:", "    def __init__(self):", f"        self.child = M{c + 1}()" if c + 1 < classes
                  else "        self.child = None", "    def forward(self, x):"]
        lines += [f"        x = self.child(x) + {k}" for k in range(body)] + ["        return x", ""]
    return "\n".join(lines) + "\n"


def many_lines(source_path, distinct=50_000):
    """Forward frames in a real source file at `distinct` different line numbers (modtree._align's worst case)."""
    stacks = []
    for i in range(0, distinct, 25):
        stacks.append([frame(source_path, 1 + i + k, "forward") for k in range(25)][::-1] +
                      [frame("/home/u/train.py", 5, "step")])
    return snapshot_with_stacks(stacks, sizes=[MiB] * len(stacks))


def many_spellings(source_path, count=3000):
    """The same source file named by `count` spellings of its path (`/d/./a/../f.py`, ...)."""
    import os

    d, f = os.path.split(source_path)
    stacks = []
    for i in range(count):
        spelled = os.path.join(d, *(["."] * (i % 7)), *([f"x{i}", ".."]), f) if i else source_path
        stacks.append([frame(spelled, 5 + i % 20, "forward"), frame("/home/u/train.py", 5, "step")])
    return snapshot_with_stacks(stacks, sizes=[MiB] * len(stacks))


def odd_lines():
    """Line numbers no file has: huge, negative, zero, a string, a float."""
    stacks = [[frame("/home/u/m.py", v, "forward"), frame("/home/u/train.py", 5, "step")]
              for v in (2**40, 2**63 - 1, -5, 0, "12", 1.5, 10**30)]
    return snapshot_with_stacks(stacks)


def device_without_entries(snap):
    """`snap` with a copy of its first segment on device 1, which has no trace entries (a multi-GPU process)."""
    import copy

    out = dict(snap)
    seg = copy.deepcopy(snap["segments"][0])
    seg["device"] = 1
    out["segments"] = list(snap["segments"]) + [seg]
    out["device_traces"] = list(snap["device_traces"][:1]) + [[]]
    return out
