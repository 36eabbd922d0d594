#!/usr/bin/env python3
"""Validate tracekit's categories against ground truth, and time them on a large file.

    .venv/bin/python bench/validate_categories.py             # accuracy table (a few minutes, 2 CPU cores)
    .venv/bin/python bench/validate_categories.py --quick     # fewer workloads
    .venv/bin/python bench/validate_categories.py --speed     # also categorize + category_series on 1M entries

Each workload is a real training loop recorded with tracekit's recorder (CPU
backend, tags on, first optimizer step inside the trace). The recorder's tags
are the truth for the tensors they name; an untagged allocation counts as a
temporary when the recorder's own phase marks show it freed in the phase
(and iteration) that made it, and is left out otherwise (its share is
printed). Accuracy is byte-weighted over the allocations live at the peak,
and byte x time over the whole trace:

  (a) tagged    what tracekit reports for the file as recorded
  (b) no tags   the tags removed, the recorder's phase marks kept
  (c) no marks  tags, phase marks and our metadata removed (a snapshot from anywhere)
  torch         torch.profiler._memory_profiler's categories of the same run

Targets: (a) >= 99 %, (b) >= 95 %.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from contextlib import contextmanager

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from tracekit.analysis.categories import CATEGORIES, categorize, allocation_times  # noqa: E402
from tracekit.analysis.phases import phases  # noqa: E402
from tracekit.analysis.replay import replay  # noqa: E402
from tracekit.io import read_document, to_trace  # noqa: E402
from tracekit.record.cpu import CpuBackend  # noqa: E402

STEPS = 3


# -- workloads: (model, optimizer, step function) -------------------------------------------------------

class Block(nn.Module):
    def __init__(self, d, heads=4):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    def __init__(self, vocab=1024, d=96, layers=2, seq=64, ckpt=False):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)
        self.ckpt = ckpt

    def forward(self, idx):
        x = self.emb(idx) + self.pos
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.ckpt else b(x)
        return self.head(x)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, r=4):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(r, base.in_features) * 0.01)
        self.b = nn.Parameter(torch.zeros(base.out_features, r))

    def forward(self, x):
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


def lm_batch(vocab=1024, batch=8, seq=64):
    t = torch.randint(vocab, (batch, seq + 1))
    return t[:, :-1], t[:, 1:]


def mlp_adam():
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step():
        x, y = torch.randn(256, 512), torch.randint(0, 10, (256,))
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt, step


def transformer_adamw(ckpt=False, autocast=False, accumulate=1):
    model = Transformer(ckpt=ckpt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        for _ in range(accumulate):
            x, y = lm_batch(batch=8 // accumulate)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(x)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)) / accumulate
            loss.backward()
        opt.step()
    return model, opt, step


def cnn_sgd():
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step():
        x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt, step


def frozen_lora():
    model = Transformer(d=128)
    model.requires_grad_(False)
    for b in model.blocks:
        b.mlp[0] = LoRALinear(b.mlp[0])
        b.mlp[2] = LoRALinear(b.mlp[2])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def step():
        x, y = lm_batch()
        opt.zero_grad()
        F.cross_entropy(model(x).reshape(-1, 1024), y.reshape(-1)).backward()
        opt.step()
    return model, opt, step


def keep_grads():
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step():
        x = torch.randn(128, 256)
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        opt.step()
    return model, opt, step


WORKLOADS = {
    "mlp_adam": mlp_adam,
    "transformer_adamw": transformer_adamw,
    "cnn_sgd_momentum": cnn_sgd,
    "autocast_bf16": lambda: transformer_adamw(autocast=True),
    "grad_accumulation_x4": lambda: transformer_adamw(accumulate=4),
    "checkpointing": lambda: transformer_adamw(ckpt=True),
    "frozen_base_lora": frozen_lora,
    "zero_grad_keep": keep_grads,
}
# Recorded after one unrecorded warm-up step: the optimizer state exists before the trace. Shown for
# what it is, a limit of inference (equal-size weights and moments cannot be told apart), not a target.
AFTER_WARMUP = {"mlp_adam_after_warmup": mlp_adam, "transformer_adamw_after_warmup": transformer_adamw}
ALL = {**WORKLOADS, **AFTER_WARMUP}
QUICK = ("mlp_adam", "transformer_adamw", "checkpointing")


# -- recording (with the torch profiler's memory profile of the same run) -------------------------------

class ProfilingCpuBackend(CpuBackend):
    """The recorder's CPU backend, with torch's own profiler (memory, stacks, shapes) running beside it for
    the whole recording, so torch's memory profiler can run on the same steps (one profile, kept whole).
    One profiler runs per process: the recorder's own (backward ranges only) stands aside while torch's
    runs and takes its backward ranges when it stops; the allocation hook records as always."""

    def start(self, preexisting=()):
        import warnings

        from torch.profiler import ProfilerActivity, profile

        super().start(preexisting)
        self.torch_profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True,
                                     record_shapes=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "your torch.profiler started while tracekit was recording"
            self.torch_profile.start()

    def stop(self):
        try:
            self.torch_profile.stop()
        finally:
            super().stop()


@contextmanager
def profiling_backend():
    from tracekit.record import recorder

    made = []
    original = recorder.make_backend

    def make(name, stacks, max_entries, **options):
        made.append(ProfilingCpuBackend(stacks=stacks, max_entries=max_entries, **options))
        return made[-1]
    recorder.make_backend = make
    try:
        yield made
    finally:
        recorder.make_backend = original


def record_workload(name, path, with_torch=True):
    from tracekit.record import Recorder

    torch.manual_seed(0)
    model, opt, step = ALL[name]()
    warmup = 1 if name in AFTER_WARMUP else 0
    t0 = time.perf_counter()
    with profiling_backend() if with_torch else _null() as made:
        rec = Recorder(path, model, opt, backend="cpu", steps=STEPS, warmup=warmup)
        with rec:
            for _ in range(warmup + STEPS):
                step()
                rec.step()
    seconds = time.perf_counter() - t0
    return (made[0].torch_profile if with_torch and made else None), seconds


@contextmanager
def _null():
    yield []


# -- measuring --------------------------------------------------------------------------------------------

def variants(path):
    """The trace as recorded, without tags, and without tags or phase marks."""
    full = to_trace(read_document(path)[0], path)
    snap, _ = read_document(path)  # a fresh copy per variant: a trace keeps the dict's "tracekit" value
    snap["tracekit"]["tags"] = []
    no_tags = to_trace(snap, path)
    snap, _ = read_document(path)
    del snap["tracekit"]
    for entries in snap["device_traces"]:
        for e in entries:
            e.pop("user_metadata", None)
    no_marks = to_trace(snap, path)
    return full, no_tags, no_marks


def truth_of(trace):
    """Truth per allocation (category index, -1 where unknown) from tags and the recorder's phase marks."""
    rep = replay(trace)[0]
    al = rep.allocations
    truth = categorize(trace)[0].tagged.astype(np.int64)
    runs = phases(trace)[0].runs()
    a, f = al.alloc_index, al.free_index
    in_phase = (a >= 0) & (f >= 0) & (runs[np.maximum(a, 0)] == runs[np.maximum(f, 0)])
    truth[(truth < 0) & in_phase] = CATEGORIES.index("temporary")
    return truth


def weights(trace):
    """(bytes live at the peak, bytes x µs over the trace) per allocation."""
    rep = replay(trace)[0]
    al = rep.allocations
    live = al.live_at(rep.peak_index)
    ta, tf = allocation_times(trace, rep)
    t = trace.events.time_us[rep.events]
    lo, hi = float(t.min()), float(t.max())
    span = np.clip(np.nan_to_num(tf, posinf=hi), lo, hi) - np.clip(np.nan_to_num(ta, neginf=lo), lo, hi)
    return al.size * live, al.size.astype(np.float64) * np.maximum(span, 1.0)


def agreement(labels, truth, w):
    known = truth >= 0
    total = float(w[known].sum())
    return float(w[known & (labels == truth)].sum()) / total if total else float("nan")


TORCH_NAMES = {"INPUT": "input", "TEMPORARY": "temporary", "ACTIVATION": "activation", "GRADIENT": "gradient",
               "AUTOGRAD_DETAIL": "temporary", "PARAMETER": "parameter", "OPTIMIZER_STATE": "optimizer_state"}


def torch_labels(prof, trace):
    """torch.profiler._memory_profiler's category per allocation (-1 where it has none)."""
    from torch.profiler._memory_profiler import Action

    mp = prof._memory_profile()
    first = {}  # (ptr, create time µs) -> first category over the tensor's versions
    created = {}
    for t_ns, action, (key, version), _ in mp.timeline:
        if getattr(key, "storage", None) is None:
            continue
        if action in (Action.CREATE, Action.PREEXISTING):
            created[key] = t_ns // 1000 if action == Action.CREATE else None
        if key in created:
            cat = mp._categories.get(key, version)
            k = (key.storage.ptr, created[key])
            if cat is not None and first.get(k) is None:
                first[k] = TORCH_NAMES.get(cat.name, "other")
            first.setdefault(k, None)
    rep = replay(trace)[0]
    al = rep.allocations
    ta, _ = allocation_times(trace, rep)
    out = np.full(len(al), -1, np.int64)
    for r, (addr, t) in enumerate(zip(al.addr.tolist(), ta.tolist())):
        name = first.get((addr, None if not np.isfinite(t) else int(t)))
        if name is None and not np.isfinite(t):
            name = first.get((addr, None))
        out[r] = CATEGORIES.index(name) if name else CATEGORIES.index("other")
    return out, mp


def measure(name, folder, with_torch=True):
    path = os.path.join(folder, f"{name}.pickle")
    prof, rec_seconds = record_workload(name, path, with_torch)
    return judge(name, path, prof, rec_seconds)


def judge(name, path, prof=None, rec_seconds=0.0):
    """The agreement row of one recording (tags are the truth; (b) and (c) strip tags, then phase marks)."""
    full, no_tags, no_marks = variants(path)
    truth = truth_of(full)
    w_peak, w_time = weights(full)
    rep = replay(full)[0]
    row = {"workload": name, "peak": rep.peak_allocated, "entries": rep.n, "record_s": rec_seconds}
    tagged = truth >= 0
    row["truth_share"] = (float(w_peak[tagged].sum()) / max(1, float(w_peak.sum())),
                          float(w_time[tagged].sum()) / max(1.0, float(w_time.sum())))
    for key, trace in (("a", full), ("b", no_tags), ("c", no_marks)):
        labels = categorize(trace)[0].labels.astype(np.int64)
        row[key] = (agreement(labels, truth, w_peak), agreement(labels, truth, w_time))
        row[key + "_totals"] = totals_agreement(labels, truth, w_peak)
    if prof is not None:
        t0 = time.perf_counter()
        try:
            tl, _ = torch_labels(prof, full)
            row["torch"] = (agreement(tl, truth, w_peak), agreement(tl, truth, w_time))
            ours = categorize(no_tags)[0].labels.astype(np.int64)
            row["torch_vs_ours"] = (agreement(tl, ours, w_peak), agreement(tl, ours, w_time))
            row["confusion_torch"] = confusion(tl, truth, w_time)
        except Exception as e:  # the profiler's classifier is private API
            row["torch_error"] = f"{type(e).__name__}: {e}"
        row["torch_s"] = time.perf_counter() - t0
    row["confusion_b"] = confusion(categorize(no_tags)[0].labels, truth, w_peak)
    unknown = truth < 0
    labels = categorize(full)[0].labels
    row["unjudged"] = {CATEGORIES[k]: float(w_peak[unknown & (labels == k)].sum()) for k in range(len(CATEGORIES))}
    return row


def totals_agreement(labels, truth, w):
    """1 - (half the L1 distance between the category totals) / bytes: right totals, whatever the identities."""
    known = truth >= 0
    ours = np.bincount(labels[known], weights=w[known], minlength=len(CATEGORIES))
    true = np.bincount(truth[known], weights=w[known], minlength=len(CATEGORIES))
    total = float(w[known].sum())
    return 1 - float(np.abs(ours - true).sum()) / 2 / total if total else float("nan")


def confusion(labels, truth, w, top=3):
    out = {}
    for t, got, wt in zip(truth.tolist(), labels.tolist(), w.tolist()):
        if t >= 0 and t != got and wt:
            k = f"{CATEGORIES[t]}->{CATEGORIES[got]}"
            out[k] = out.get(k, 0) + wt
    return sorted(out.items(), key=lambda kv: -kv[1])[:top]


# -- speed ------------------------------------------------------------------------------------------------

def speed(folder, entries=1_000_000):
    import subprocess

    from tracekit import load
    from tracekit.analysis.timeline import category_series

    src = os.path.join(ROOT, "..", "shared", "fixtures", "real", "snapshot_newest_format_windows_paths.pickle")
    tile = os.path.join(ROOT, "..", "shared", "bench", "tile_snapshot.py")
    out = os.path.join(folder, "big.pickle")
    subprocess.run([sys.executable, tile, src, out, "--entries", str(entries)], check=True, capture_output=True)
    trace = load(out, use_cache=False)
    t0 = time.perf_counter()
    replay(trace)
    t1 = time.perf_counter()
    categorize(trace)
    t2 = time.perf_counter()
    s = category_series(trace, 0, max_points=4000)
    t3 = time.perf_counter()
    full = category_series(trace, 0)
    t4 = time.perf_counter()
    assert (sum(full.by_category.values()) == full.total).all()
    from tracekit.analysis.report import build_report

    build_report(trace)
    t5 = time.perf_counter()
    print(f"\nspeed on {len(trace.events):,} entries: replay {t1 - t0:.2f} s, categorize {t2 - t1:.2f} s, "
          f"category_series(4000 points) {t3 - t2:.2f} s, full series {t4 - t3:.2f} s "
          f"({len(s.index)} points; categories sum to allocated at all {len(full.index):,} entries), "
          f"whole report with findings {t5 - t4:.2f} s")


# -- main -------------------------------------------------------------------------------------------------

def pct(x):
    return "   n/a" if x is None or x != x else f"{100 * x:5.1f}%"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    ap.add_argument("--no-torch", action="store_true", help="skip torch.profiler's classifier")
    ap.add_argument("--speed", action="store_true", help="also time categorize + category_series on 1M entries")
    ap.add_argument("--only", nargs="*", choices=list(ALL), help="workload names")
    ap.add_argument("--files", nargs="+", help="judge these recordings of our recorder (e.g. CUDA samples) instead")
    args = ap.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    names = [] if args.files else args.only or (QUICK if args.quick else list(ALL))
    rows = [judge(os.path.basename(p).split(".")[0], p) for p in args.files or []]
    with tempfile.TemporaryDirectory() as folder:
        for name in names:
            rows.append(measure(name, folder, with_torch=not args.no_torch))
            r = rows[-1]
            print(f"  {name}: recorded {r['entries']} entries in {r['record_s']:.1f} s"
                  + (f", torch classifier {r['torch_s']:.1f} s" if "torch_s" in r else ""), file=sys.stderr)
        print_table(rows)
        if args.speed:
            speed(folder)
    judged = [r for r in rows if r["workload"] not in AFTER_WARMUP]
    ok = all(r["a"][0] >= 0.99 and r["a"][1] >= 0.99 and r["b"][0] >= 0.95 and r["b"][1] >= 0.95 for r in judged)
    print(f"\ntargets (a) >= 99%, (b) >= 95% at the peak and over time, recordings with the first optimizer "
          f"step ({len(judged)} workloads): {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


def print_table(rows):
    print("\nbyte-weighted agreement with the truth: at the peak | over the trace (bytes x time)")
    head = (f"{'workload':<22} {'peak':>9} {'truth':>15} {'(a) tagged':>15} {'(b) no tags':>15} "
            f"{'(c) no marks':>15} {'torch profiler':>15}")
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = [f"{pct(r[k][0])} {pct(r[k][1])}" if k in r else f"{'n/a':>13}"
                 for k in ("truth_share", "a", "b", "c", "torch")]
        print(f"{r['workload']:<22} {r['peak'] / 2**20:7.1f}Mi " + " ".join(f"{c:>15}" for c in cells))
    print("\ntruth: share of the bytes whose category is known (tagged, or untagged and freed inside its phase)")
    mean = {k: np.mean([r[k][0] for r in rows if k in r]) for k in ("a", "b", "c", "torch") if any(k in r for r in rows)}
    print("mean at the peak: " + ", ".join(f"{k} {pct(v)}" for k, v in mean.items()))
    for r in rows:
        total = sum(r["unjudged"].values())
        if total:
            print(f"  {r['workload']}: bytes at the peak without a truth ({total / 2**20:.2f} MiB: untagged, live "
                  "across phases) are labelled " + ", ".join(f"{k} {v / total:.0%}" for k, v in
                                                             sorted(r["unjudged"].items(), key=lambda kv: -kv[1]) if v))
    for r in rows:
        if r["b"][0] < 0.99:
            print(f"  (b) {r['workload']}: category totals at the peak agree {pct(r['b_totals'])} "
                  f"(per allocation {pct(r['b'][0])})")
    for r in rows:
        if r["confusion_b"]:
            print(f"  (b) {r['workload']}: largest misses at the peak: "
                  + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in r["confusion_b"]))
        if r.get("confusion_torch"):
            total = sum(r["confusion_torch"][k][1] for k in range(len(r["confusion_torch"])))
            print(f"  torch profiler {r['workload']}: largest misses over time: "
                  + ", ".join(f"{k} {v / total:.0%}" for k, v in r["confusion_torch"]))
        if "torch_error" in r:
            print(f"  torch profiler failed on {r['workload']}: {r['torch_error']}")


if __name__ == "__main__":
    sys.exit(main())
