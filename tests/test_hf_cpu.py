"""Other Hugging Face architectures, recorded here on the CPU and stripped of everything our recorder adds
(tags, phases, modules, forward frames, categories), so they read like a snapshot made anywhere else: the
modules come from the stacks (named from the installed transformers, the version that ran them), a
generation is recognised and its KV cache grows by the analytic bytes per step."""
import pickle

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import tracekit  # noqa: E402
from tracekit.analysis.report import build_report  # noqa: E402
from tracekit.io import load  # noqa: E402
from tracekit.io.unpickle import restricted_load  # noqa: E402

LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB, BATCH, PROMPT, NEW = 3, 64, 4, 2, 500, 2, 8, 6
ARCHS = {
    "gpt2": ("GPT2LMHeadModel > GPT2Model > GPT2Block ×3 > GPT2Attention", HEADS,
             lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
                 n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB, n_positions=128))),
    "llama": ("LlamaForCausalLM > LlamaModel > LlamaDecoderLayer ×3 > LlamaAttention", KV_HEADS,
              lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
                  num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                  max_position_embeddings=128))),
}


def _foreign(path, out):
    """The recording as someone else's snapshot: no "tracekit" key, nothing of ours on the entries."""
    with open(path, "rb") as f:
        snap = restricted_load(f)
    snap.pop("tracekit", None)
    for entries in snap["device_traces"]:
        for e in entries:
            for key in ("module", "forward_frames", "category", "user_metadata"):
                e.pop(key, None)
    with open(out, "wb") as f:
        pickle.dump(snap, f, protocol=4)
    return out


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch(request, tmp_path_factory):
    name = request.param
    classes, kv_heads, build = ARCHS[name]
    tmp = tmp_path_factory.mktemp(name)
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (BATCH, 32))
    with tracekit.record(str(tmp / "train.pickle"), model=model, optimizer=opt) as rec:
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            rec.step()
    model.eval()
    with tracekit.record(str(tmp / "gen.pickle"), model=model):
        model.generate(ids[:, :PROMPT], max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
    return {"name": name, "classes": classes, "kv_heads": kv_heads,
            "train": _foreign(tmp / "train.pickle", tmp / "train_foreign.pickle"),
            "gen": _foreign(tmp / "gen.pickle", tmp / "gen_foreign.pickle")}


def test_modules_from_the_stacks_by_the_installed_source(arch):
    table = build_report(load(arch["train"]))["devices"][0]["modules"]
    assert table["source"] == "stacks"
    chains = {g["classes"] for g in table["layers"] if g.get("classes")}
    assert arch["classes"] in chains
    assert all(r.get("how") == "by source" for r in table["rows"] if r["module"] != "(outside any module)")


def test_library_lines_name_the_models_file(arch):
    dev = build_report(load(arch["train"]))["devices"][0]
    files = {r["library_frame"]["filename"].rsplit("/", 1)[-1] for r in dev["library_sites_at_peak"]}
    assert f"modeling_{arch['name']}.py" in files
    assert dev["workload"] == "training"


def test_generation_and_its_kv_cache(arch):
    dev = build_report(load(arch["gen"]))["devices"][0]
    assert dev["workload"] == "generation"
    head_dim = HIDDEN // HEADS
    per_step = 2 * LAYERS * BATCH * arch["kv_heads"] * head_dim * 4  # fp32 keys and values, all layers
    kv = dev["kv_cache"]
    assert kv["steps"] == NEW - 1 and dev["generation"]["decode_steps"] == NEW - 1
    assert kv["bytes_per_step"] == per_step
    assert kv["bytes_at_prefill"] == per_step * PROMPT
    assert kv["bytes_final"] == per_step * (PROMPT + NEW - 1)
