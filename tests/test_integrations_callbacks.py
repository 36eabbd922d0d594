"""Hugging Face Trainer and Lightning callbacks on tiny real models built from configs, on the CPU."""
import pytest

import tracekit

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")


def _param_bytes(model):
    seen = {}
    for p in model.parameters():
        seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


def _check(path, model, optimizer_state_tensors_per_param):
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None  # every hook removed
    rec = tracekit.load(path)
    meta = rec.recorder
    assert [it["iteration"] for it in meta["iterations"]] == [1, 2, 3]  # warm-up step 0 not recorded
    assert {p["phase"] for p in meta["phases"]} == {"forward", "backward", "optimizer"}
    assert meta["model"]["parameter_bytes"] == _param_bytes(model)
    (d,) = rec.report()["devices"]
    kinds = {t["kind"] for t in meta["tags"]}
    assert {"parameter", "gradient", "optimizer_state"} <= kinds
    al = rec.allocations()
    live_end = al[al.free_entry.isna()]
    by_cat = live_end.groupby("category", observed=True)["size"].sum()
    # parameters and optimizer state are live at the end, at their independent sizes
    assert int(by_cat.get("parameter", 0)) >= _param_bytes(model)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert int(by_cat.get("optimizer_state", 0)) >= optimizer_state_tensors_per_param * trainable * 0.99
    return rec


def test_transformers_trainer(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from tracekit.integrations.transformers import TracekitCallback

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 97, (32, 16))
    data = [{"input_ids": x, "labels": x} for x in ids]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=5, per_device_train_batch_size=4,
                                          report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
                                          disable_tqdm=True, learning_rate=1e-3)
    cb = TracekitCallback(str(tmp_path / "trainer.pickle"), warmup_steps=1, steps=3, backend="cpu")
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]).train()
    assert cb.written == str(tmp_path / "trainer.pickle")
    out = capsys.readouterr().out
    assert f"tracekit: {cb.written}: 3 steps, peak " in out and "on cpu" in out
    _check(cb.written, model, optimizer_state_tensors_per_param=2)  # AdamW: exp_avg, exp_avg_sq


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_trainer(tmp_path, capsys, accumulate):
    pl = pytest.importorskip("lightning.pytorch")
    from tracekit.integrations.lightning import TracekitCallback

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 64), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model = Tiny()
    cb = TracekitCallback(str(tmp_path / "pl.pickle"), warmup_steps=1, steps=3, backend="cpu")
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                         accumulate_grad_batches=accumulate)
    trainer.fit(model, loader)
    assert cb.written == str(tmp_path / "pl.pickle")
    assert f"tracekit: {cb.written}: 3 steps" in capsys.readouterr().out
    rec = _check(cb.written, model, optimizer_state_tensors_per_param=1)  # SGD momentum buffer
    forwards = [p for p in rec.recorder["phases"] if p["phase"] == "forward"]
    assert len(forwards) == 3 * accumulate  # each recorded step is `accumulate` batches
    assert "training_step" not in model.__dict__  # the class's method again


def test_rank_aware_names(tmp_path, monkeypatch):
    from tracekit.integrations.steps import StepRecorder

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    r = StepRecorder(str(tmp_path / "m.pickle"), warmup_steps=0, steps=2, backend="cpu", log=None)
    r.begin(model, opt)
    try:
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            r.step()
    finally:
        r.end()
    assert r.written == str(tmp_path / "m.rank1.pickle")


def test_marks_closure_inside_optimizer_step():
    """optimizer.step(closure) runs forward and backward itself (Lightning, LBFGS): they keep their phases."""
    import itertools

    from tracekit.record.marks import Marks

    clock = itertools.count(100, 10)
    m = Marks(clock=lambda: next(clock))
    m.start()
    for _ in range(2):
        m.optimizer_started()
        m.forward_started()            # the closure's forward
        m.backward_started()
        m.forward_started()            # checkpoint recompute inside backward: stays backward
        m.backward_ended()
        m.optimizer_ended()            # the update after the closure
        m.step()
    m.finish()
    got = [(p["iteration"], p["phase"]) for p in m.phases]
    assert got == [(0, "optimizer"), (0, "forward"), (0, "backward"), (0, "optimizer"),
                   (1, "optimizer"), (1, "forward"), (1, "backward"), (1, "optimizer")]
    assert all(a["end_us"] <= b["start_us"] for a, b in zip(m.phases, m.phases[1:]))  # no overlap
