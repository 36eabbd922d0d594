"""The per-run and per-stack shortcuts of phases, sites and the module tree (issue 35) give what the per-entry
passes they replaced gave: each checked against that pass, kept here as the reference, on random inputs and
real files."""
from pathlib import Path

import numpy as np
import pytest

from tracekit.analysis import phases as ph
from tracekit.model import ACTIONS, ALLOC, FREE_COMPLETED

ROOT = Path(__file__).resolve().parents[1]
SHARED = next((p / "shared" for p in ROOT.parents if (p / "shared/fixtures").is_dir()), ROOT.parent / "shared")


# -- phases: evidence codes from a (stack, kind) table ----------------------------------------------------------

def _codes_per_entry(flags_of_stack, action, stack):
    """The evidence codes as phases._inferred made them before issue 35: masks over every entry."""
    flags = flags_of_stack[stack + 1]
    is_alloc, is_free = action == ALLOC, action == FREE_COMPLETED
    code = np.zeros(len(action), np.int8)
    has_frames = stack >= 0
    has = lambda bits: has_frames & ((flags & bits) != 0)  # noqa: E731
    code[has(ph.F_USER)] = ph._E_USER
    code[has(ph.F_USER) & has(ph.F_FACTORY)] = ph._E_FACTORY
    code[has(ph.F_MODULE)] = ph._E_FORWARD
    code[has(ph.F_MODULE) & has(ph.F_CHECKPOINT)] = ph._E_RECOMPUTE
    code[has(ph.F_BACKWARD)] = ph._E_BACKWARD
    code[has(ph.F_OPTIM)] = ph._E_OPTIM
    code[has(ph.F_ZERO_GRAD)] = ph._E_ZERO
    code[~(is_alloc | is_free) & np.isin(code, (ph._E_USER, ph._E_FACTORY))] = ph._E_NONE
    if (is_alloc & has_frames).any():
        code[is_alloc & ~has_frames] = ph._E_FRAMELESS
    return code


def _run_starts_per_entry(code):
    nz = np.flatnonzero(code)
    if not len(nz):
        return np.zeros(0, np.int64)
    cz = code[nz]
    return nz[np.r_[True, cz[1:] != cz[:-1]]]


BITS = [ph.F_USER, ph.F_FACTORY, ph.F_MODULE, ph.F_CHECKPOINT, ph.F_BACKWARD, ph.F_OPTIM, ph.F_ZERO_GRAD,
        ph.F_DATA, ph.F_COMM]


@pytest.mark.parametrize("seed", range(40))
def test_evidence_codes_are_the_per_entry_masks(seed):
    rng = np.random.default_rng(seed)
    stacks = int(rng.integers(1, 30))
    flags = np.zeros(stacks + 1, np.int32)
    for s in range(1, stacks + 1):
        for b in rng.choice(BITS, int(rng.integers(0, 4)), replace=False):
            flags[s] |= b
    n = int(rng.integers(0, 3000))
    action = rng.choice(np.arange(len(ACTIONS), dtype=np.int8), n, p=None if seed % 3 else
                        np.r_[0.4, 0.1, 0.4, [0.1 / (len(ACTIONS) - 3)] * (len(ACTIONS) - 3)])
    no_stack = rng.random() * (1.0 if seed % 4 else 0.0)
    stack = np.where(rng.random(n) < no_stack, -1, rng.integers(0, stacks, n)).astype(np.int32)
    if seed % 5 == 0:  # no allocation has a stack: no frameless allocation
        stack[action == ALLOC] = -1
    # runs of one stack, as real traces have them
    if seed % 2 and n:
        stack = np.repeat(stack[: max(1, n // 20)], 20)[:n]
        stack = np.r_[stack, np.full(n - len(stack), -1, np.int32)]
    want = _codes_per_entry(flags, action, stack)
    for chunk in (1 << 20, 7, 64):
        code, frameless, n_alloc, starts = ph._evidence_codes(flags, action, stack, chunk=chunk)
        assert np.array_equal(code, want)
        assert frameless == int((want == ph._E_FRAMELESS).sum())
        assert n_alloc == int((action == ALLOC).sum())
        assert np.array_equal(starts, _run_starts_per_entry(want))
        assert np.array_equal(ph._run_starts(want, chunk), starts)
        assert set(code[starts].tolist()) == set(want.tolist()) - {0}


@pytest.mark.parametrize("seed", range(30))
def test_resolve_gives_the_runs_of_its_phases(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 2000))
    code = np.where(rng.random(n) < 0.3, rng.integers(1, 9, n), 0).astype(np.int8)
    code = np.repeat(code, int(rng.integers(1, 5)))[:n]
    phase, iteration, starts = ph._resolve(code)
    fresh = ph.DevicePhases(phase=phase, iteration=iteration, source="inferred").run_starts()
    assert np.array_equal(starts, fresh) and starts.dtype == fresh.dtype


# -- phases: run_of by blocks, next_at by runs -----------------------------------------------------------------

def _next_of_per_entry(phase, p):
    n = len(phase)
    out = np.full(n + 1, n, np.int64)
    for i in range(n - 1, -1, -1):
        out[i] = i if phase[i] == p else out[i + 1]
    return out


@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000, 70_001])
@pytest.mark.parametrize("runs", [1, 4, 60, 0.1, 0.6])
def test_run_of_and_next_at_are_the_per_entry_lookups(n, runs):
    rng = np.random.default_rng(n)
    k = int(runs * n) + 1 if isinstance(runs, float) else runs
    phase = np.zeros(n, np.int8)
    iteration = np.zeros(n, np.int32)
    for i, c in enumerate(np.sort(rng.integers(0, n, k))):
        phase[c:] = rng.integers(0, 4)
        iteration[c:] = i // 3
    p = ph.DevicePhases(phase=phase, iteration=iteration, source="inferred")
    runs_of_entries = p.runs()
    at = rng.integers(0, n, 9000)
    at_n = np.r_[at, n, 0, n - 1]  # next_at takes n too
    assert np.array_equal(p.run_of(at), runs_of_entries[at])
    assert np.array_equal(p.run_of(np.sort(at).astype(np.int32)), runs_of_entries[np.sort(at)])
    assert not p.run_starts().flags.writeable
    for q in range(4):
        want = _next_of_per_entry(phase, q)
        got = p.next_at(q, at_n)
        assert np.array_equal(got, want[at_n]) and got.dtype == np.int32
        assert np.array_equal(p.next_at(q, at_n, p.run_of(at_n)), got)
        assert np.array_equal(p.next_of(q), want)


def test_distinct_ids_is_numpys_unique():
    rng = np.random.default_rng(3)
    for bound in (1, 5, 300):
        v = rng.integers(0, bound, 5000).astype(np.int32)
        assert np.array_equal(ph._distinct_ids(v, bound, chunk=100), np.unique(v))
    const = np.broadcast_to(np.int32(4), (10,))
    assert ph._distinct_ids(const, 5).tolist() == [4]
    assert ph._distinct_ids(np.array([7, -1, 7], np.int32), 3).tolist() == [-1, 7]  # out of bounds: numpy's


# -- sites: only the alloc entries looked up --------------------------------------------------------------------

def _borrowed_per_entry(stack, user_frame, runs):
    """Each entry's site as sites._borrowed_entry_sites made it before issue 35 (a scan of every entry)."""
    n = len(stack)
    out = stack.copy()
    has_user = user_frame[stack + 1] >= 0
    for i in range(n):
        if has_user[i] or stack[i] < 0:
            continue
        j = i - 1
        while j >= 0 and not has_user[j]:
            j -= 1
        if j >= 0 and runs[j] == runs[i]:
            out[i] = stack[j]
            continue
        j = i + 1
        while j < n and not has_user[j]:
            j += 1
        if j < n and runs[j] == runs[i]:
            out[i] = stack[j]
    return out


@pytest.mark.parametrize("seed", range(25))
def test_borrowed_sites_are_the_nearest_user_entry_of_the_run(seed):
    from tracekit.analysis.sites import _borrowed_sites

    rng = np.random.default_rng(seed)
    stacks = int(rng.integers(1, 12))
    user_frame = np.where(rng.random(stacks + 1) < (0.5 if seed % 4 else 0.0), rng.integers(0, 50, stacks + 1), -1)
    user_frame[0] = -1
    user_frame = user_frame.astype(np.int32)
    n = int(rng.integers(1, 1500))
    stack = rng.integers(-1, stacks, n).astype(np.int32)
    phase = np.repeat(rng.integers(0, 4, n // 7 + 1), 7)[:n].astype(np.int8)
    iteration = np.zeros(n, np.int32)
    p = ph.DevicePhases(phase=phase, iteration=iteration, source="inferred")
    want = _borrowed_per_entry(stack, user_frame, p.runs())
    at = rng.choice(n, int(rng.integers(1, n + 1)), replace=False)
    if seed % 2:
        at = np.sort(at)
    got = _borrowed_sites(stack, user_frame, at.astype(np.int64), p, chunk=int(rng.integers(1, 300)))
    assert np.array_equal(got, want[at])


# -- real files: each shortcut against the pass it replaced -----------------------------------------------------

REAL = [p for p in [SHARED / "fixtures/real/snapshot_newest_format_windows_paths.pickle",
                    SHARED / "fixtures/real/snapshot_cpp_frames_adamw_full_step.pickle",
                    SHARED / "fixtures/real/snapshot_cpp_frames_attention_fwd_bwd.pickle",
                    ROOT / "samples/gpt_adamw_cpp_stacks_cuda.pickle"] if p.exists()]


@pytest.mark.parametrize("path", REAL, ids=lambda p: p.name)
def test_real_files_phases_sites_and_modules(path):
    from tracekit.analysis.modtree import _path, _unique_rows, allocation_modules, stack_modules
    from tracekit.analysis.libraries import allocation_libraries
    from tracekit.analysis.replay import replay
    from tracekit.analysis.sites import _borrowed_sites, stack_sites
    from tracekit.io import load

    trace = load(path, use_cache=False)
    for d in trace.devices:
        rep = replay(trace)[d]
        p = ph.phases(trace)[d]
        sl = trace.events.device_slice(d)
        if p.source == "inferred" and p.generation is None:
            stack = trace.events.stack_id[sl]
            assert np.array_equal(ph._evidence_codes(ph.stack_flags(trace), trace.events.action[sl], stack)[0],
                                  _codes_per_entry(ph.stack_flags(trace), trace.events.action[sl], stack))
        stack = trace.events.stack_id[sl]
        want = _borrowed_per_entry(stack, stack_sites(trace).user_frame, p.runs())
        at = np.arange(len(stack))
        assert np.array_equal(_borrowed_sites(stack, stack_sites(trace).user_frame, at, p), want)
        # the module of each allocation by its stack's table = by the rows' unique keys
        am = allocation_modules(trace, d)
        sm = stack_modules(trace)
        al = rep.allocations
        src = np.asarray(allocation_libraries(trace, d).source)
        st = np.where(src >= 0, al.stack_id[np.maximum(src, 0)], al.stack_id).astype(np.int64)
        with_chain = np.array([bool(c) for c in sm.chains], bool)
        rows = np.flatnonzero(with_chain[st + 1])
        module = np.zeros(len(al), np.int32)
        names = {"": 0}
        if len(rows) and not any(n.looped for n in sm.nodes):
            uniq, inv = _unique_rows([st[rows]])
            ids = []
            for r in uniq.tolist():
                path, cls, _ = _path(sm.nodes, sm.chains[r[0] + 1], ())
                ids.append(names.setdefault(path, len(names)))
                names.setdefault(cls, len(names))
            module[rows] = np.array(ids, np.int32)[inv]
            assert np.array_equal(am.module, module)
            assert list(am.names)[:len(names)] == list(names)
