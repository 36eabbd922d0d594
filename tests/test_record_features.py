"""Autograd features and awkward settings under the recorder (issue 26): activation checkpointing
(reentrant or not, and transformers' gradient_checkpointing_enable), nested recordings, forked
DataLoader workers, other threads. Numerics never change, the step never crashes, the file is written;
what cannot be recorded is said once. CUDA variants (marked `cuda`) run on a GPU machine."""
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest

torch = pytest.importorskip("torch")

import tracekit  # noqa: E402
from tracekit.analysis.replay import replay  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402


class Blocks(torch.nn.Module):
    def __init__(self, reentrant=None, n=3, d=32):
        super().__init__()
        self.reentrant = reentrant
        self.inp = torch.nn.Linear(d, d)  # so that the blocks' inputs require grad (reentrant checkpoint needs it)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)) for _ in range(n))

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + (b(x) if self.reentrant is None else checkpoint(b, x, use_reentrant=self.reentrant))
        return x


def _train(reentrant, path=None, steps=3, device="cpu", **options):
    torch.manual_seed(0)
    model = Blocks(reentrant).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 32, device=device)
    out = []

    def step():
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())

    if path is None:
        for _ in range(steps):
            step()
    else:
        with tracekit.record(path, model=model, optimizer=opt, backend=device, **options) as rec:
            for _ in range(steps):
                step()
                rec.step()
    return out, [p.detach().cpu().clone() for p in model.parameters()]


@pytest.mark.parametrize("reentrant", [None, True, False])
def test_checkpointing_records_with_bit_identical_numerics(tmp_path, reentrant):
    from torch.utils import checkpoint as cp

    before = cp._enable_checkpoint_early_stop
    plain = _train(reentrant)
    got = _train(reentrant, tmp_path / "c.pickle")
    assert [x.hex() for x in got[0]] == [x.hex() for x in plain[0]]
    assert all(torch.equal(a, b) for a, b in zip(got[1], plain[1]))
    assert cp._enable_checkpoint_early_stop == before  # the CPU leaves early stop as it was
    trace = tracekit.load(tmp_path / "c.pickle", use_cache=False)
    (rep,) = replay(trace).values()
    assert rep.invariant.ok, rep.invariant.problems
    assert [p["phase"] for p in trace.recorder["phases"]][:3] == ["forward", "backward", "optimizer"]
    if reentrant is False:
        # the recomputation inside backward is logged at its own forward lines (the block's Linear)
        ev = trace.events
        names = {trace.strings[m] for m in set(ev.module.tolist()) if m > 0}
        assert any(n.startswith("blocks.") for n in names)


HF_CHECKPOINTING = textwrap.dedent("""
    import sys, torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Qwen2ForCausalLM(cfg).to(sys.argv[1])
    model.gradient_checkpointing_enable()  # non-reentrant, transformers' default
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 512, (2, 32), device=sys.argv[1])
    for step in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        print("loss", loss.item().hex())
""")


def _run_checkpointed(tmp_path, device, *record_args):
    pytest.importorskip("transformers")
    script = tmp_path / "hf_ckpt.py"
    script.write_text(HF_CHECKPOINTING)
    plain = subprocess.run([sys.executable, str(script), device], capture_output=True, text=True, timeout=600,
                           cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]
    rec = subprocess.run([sys.executable, "-m", "tracekit.cli", "record", "-o", "hf.pickle", *record_args, "--",
                          sys.executable, str(script), device], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert rec.returncode == 0, rec.stderr[-3000:]  # never a segfault (139) or a SystemError
    assert rec.stdout == plain.stdout
    return tracekit.load(str(tmp_path / "hf.pickle"), use_cache=False)


@pytest.mark.slow
def test_transformers_gradient_checkpointing_on_cpu(tmp_path):
    trace = _run_checkpointed(tmp_path, "cpu", "--backend", "cpu")
    assert len(trace.events) > 100


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("stacks", ["python", "all"])
def test_transformers_gradient_checkpointing_on_cuda(tmp_path, stacks):
    """torch's own history crashed here (SystemError in run_backward, then exit 139) with early stop on."""
    trace = _run_checkpointed(tmp_path, "cuda", "--backend", "cuda", "--stacks", stacks)
    assert trace.recorder["settings"]["checkpoint_early_stop"] is False
    (rep,) = replay(trace).values()
    assert rep.invariant.ok, rep.invariant.problems


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_on_cuda_in_process(tmp_path, reentrant):
    plain = _train(reentrant, device="cuda")
    again = _train(reentrant, device="cuda")
    if plain[0] != again[0]:
        pytest.skip("this GPU is not deterministic from run to run")
    got = _train(reentrant, tmp_path / "g.pickle", device="cuda")
    assert [x.hex() for x in got[0]] == [x.hex() for x in plain[0]]


def test_nested_recordings_the_inner_one_says_so_and_records_nothing(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracekit.record(tmp_path / "outer.pickle", backend="cpu") as outer:
            model(torch.ones(2, 8)).sum().backward()
            with tracekit.record(tmp_path / "inner.pickle", backend="cpu") as inner:
                model(torch.ones(2, 8)).sum().backward()
            model(torch.ones(2, 8)).sum().backward()
    messages = [str(w.message) for w in caught if "tracekit" in str(w.message)]
    assert sum("another tracekit recording is running" in m for m in messages) == 1
    assert inner.written is None and not (tmp_path / "inner.pickle").exists()
    trace = tracekit.load(outer.written, use_cache=False)
    assert len(trace.recorder["phases"]) >= 6  # the outer one saw all three backward passes
    (rep,) = replay(trace).values()
    assert rep.invariant.ok


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((16,), float(i)), torch.tensor(i % 4)


@pytest.mark.slow
def test_forked_dataloader_workers(tmp_path):
    """Workers forked while recording inherit the hooks: they record nothing and run as without us."""
    if "fork" not in torch.multiprocessing.get_all_start_methods():
        pytest.skip("no fork here")

    def train(path=None):
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = torch.utils.data.DataLoader(Squares(), batch_size=8, num_workers=2,
                                             multiprocessing_context="fork")
        losses = []

        def epoch():
            for x, y in loader:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())

        if path is None:
            epoch()
        else:
            with tracekit.record(path, model=model, optimizer=opt, backend="cpu"):
                epoch()
        return losses

    plain = train()
    got = train(tmp_path / "dl.pickle")
    assert [x.hex() for x in got] == [x.hex() for x in plain]
    trace = tracekit.load(tmp_path / "dl.pickle", use_cache=False)
    assert len(trace.recorder["iterations"]) >= 8


def test_other_threads_run_untouched(tmp_path):
    """Torch work on another thread while recording: it runs (same results), the step is recorded."""
    results = {}

    def worker():
        g = torch.Generator().manual_seed(1)
        a = torch.randn(64, 64, generator=g)
        results["worker"] = (a @ a).softmax(-1).sum().item()

    worker()
    expected = results.pop("worker")
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    with tracekit.record(tmp_path / "t.pickle", model=model, backend="cpu"):
        t = threading.Thread(target=worker)
        t.start()
        model(torch.randn(8, 32)).sum().backward()
        t.join()
    assert results["worker"] == expected
    trace = tracekit.load(tmp_path / "t.pickle", use_cache=False)
    (rep,) = replay(trace).values()
    assert rep.invariant.ok, rep.invariant.problems


def test_compiled_region_runs_with_the_op_log_on(tmp_path):
    """Inside code torch.compile traces, the op log's handler only calls through (no graph break: the
    compiled function gives the same result, once compiled)."""
    pytest.importorskip("torch._dynamo")

    def f(x):
        return (x @ x.T).softmax(-1).sum()

    x = torch.randn(16, 16)
    expected = f(x)
    compiled = torch.compile(f, backend="eager", fullgraph=True)
    with tracekit.record(tmp_path / "k.pickle", backend="cpu"):
        got = compiled(x)
    assert torch.equal(got, expected)
    assert os.path.exists(tmp_path / "k.pickle")
