"""Parameter counts from config.json without transformers, checked against transformers itself.

The oracle is independent of the formulas: transformers builds each config on
the meta device (no weights, no download) and counts model.parameters(). The
fixtures are the config.json fields of public models (tests/fixtures/configs,
published counts and their sources in published.json) and the configs of the
CUDA recordings (truth.json gives their counts, so that check needs no
transformers at all).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tracekit.analysis.estimate.shapes import KNOWN, LLAMA_LIKE, from_hf_config
from tracekit.cli import main

FIX = Path(__file__).parent / "fixtures"
CONFIGS = {p.stem: json.loads(p.read_text()) for p in sorted((FIX / "configs").glob("*.json"))
           if p.name != "published.json"}
PUBLISHED = {k: v for k, v in json.loads((FIX / "configs" / "published.json").read_text()).items()
             if not k.startswith("_")}
TRUTH = json.loads((FIX / "cuda" / "truth.json").read_text())["files"]


def meta_count(cfg: dict) -> int:
    """transformers' own model for `cfg`, built on the meta device, counted."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    values = {k: v for k, v in cfg.items() if k != "model_type" and not k.startswith("_")}
    values.pop("quantization_config", None)  # DeepSeek-V3's fp8 settings: not what is being counted
    config = transformers.AutoConfig.for_model(cfg["model_type"], **values)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def test_every_public_config_has_a_published_count():
    assert set(CONFIGS) == set(PUBLISHED)
    assert len(CONFIGS) >= 20


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_public_config_counts_match_transformers(name):
    shape = from_hf_config(CONFIGS[name], name)
    assert shape.params() == meta_count(CONFIGS[name])
    assert shape.counted_by == f"the formula for model_type {CONFIGS[name]['model_type']!r}"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_public_config_counts_match_published(name):
    pub, shape = PUBLISHED[name], from_hf_config(CONFIGS[name], name)
    n = shape.params()
    if pub["counts"] == "modules":
        assert n == pub["params"]
    elif pub["counts"] == "stored":  # the checkpoint stores the tied output layer a second time
        assert shape.tied and n + shape.vocab * shape.hidden == pub["params"]
    else:  # a nominal size: the count rounds to it at the precision it is given
        assert abs(n - pub["params"]) <= 0.06 * pub["params"], (n, pub)


@pytest.mark.parametrize("name", sorted(TRUTH))
def test_cuda_fixture_configs_match_truth(name):
    """No transformers needed: truth.json counted the models it recorded."""
    entry = TRUTH[name]
    shape = from_hf_config(entry["config"], name)
    if "params" in entry:
        assert shape.params() == entry["params"]
    else:  # the generation file gives the bf16 weights' bytes
        assert shape.params() * 2 == entry["param_bytes"]


def test_the_issue_figures():
    """The counts the issue found wrong: Falcon-7B +57%, Mixtral -84.5%, OPT-1.3B -0.32%, Phi-2 -0.03%, and OPT's
    learned positions."""
    opt = from_hf_config(TRUTH["opt_amp_adamw_b4_s256.pickle.gz"]["config"])
    assert opt.params() == 35_824_640 and opt.positions == 1024 + 2
    assert from_hf_config(CONFIGS["falcon-7b"]).params() == 6_921_720_704
    assert from_hf_config(CONFIGS["mixtral-8x7b"]).params() == 46_702_792_704
    assert from_hf_config(CONFIGS["opt-1.3b"]).params() == 1_315_758_080
    assert from_hf_config(CONFIGS["phi-2"]).params() == 2_779_683_840


def test_moe_active_params():
    mixtral = from_hf_config(CONFIGS["mixtral-8x7b"])
    # Mistral's announcement: 12.9B parameters used per token (top 2 of 8 experts)
    assert round(active_params(mixtral) / 1e9, 1) == 12.9
    qwen3 = from_hf_config(CONFIGS["qwen3-30b-a3b"])
    assert 3.3e9 <= active_params(qwen3) < 3.4e9  # "A3B": 3.3B activated (model card)


# -- every model type the formulas know, in small configs with their options switched, against transformers -----
SMALL = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=97, intermediate_size=96,
             pad_token_id=None, num_key_value_heads=4, head_dim=16)
FLAGS = [{}, {"tie_word_embeddings": True}, {"tie_word_embeddings": False}, {"attention_bias": True},
         {"mlp_bias": True}, {"num_key_value_heads": 2}, {"num_key_value_heads": 1}]
GPT = dict(n_embd=64, n_layer=3, n_head=4, vocab_size=97, n_positions=32)
OPT = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=97, ffn_dim=96,
           max_position_embeddings=32, word_embed_proj_dim=64)
NOHEAD = {k: v for k, v in SMALL.items() if k not in ("num_key_value_heads", "head_dim")}
MOE = dict(SMALL, num_experts_per_tok=2)
MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
CASES = {
    "gpt2": [GPT, dict(GPT, n_inner=80, tie_word_embeddings=False)],
    "gpt_bigcode": [GPT, dict(GPT, multi_query=False, n_inner=80)],
    "gpt_neo": [dict(hidden_size=64, num_layers=2, num_heads=4, vocab_size=97, max_position_embeddings=32,
                     attention_types=[[["global", "local"], 1]])],
    "gptj": [dict(GPT, rotary_dim=8)],
    "codegen": [dict(GPT, rotary_dim=8, n_ctx=32)],
    "opt": [OPT, dict(OPT, word_embed_proj_dim=32, do_layer_norm_before=False),
            dict(OPT, enable_bias=False, layer_norm_elementwise_affine=False, tie_word_embeddings=False)],
    "bloom": [dict(hidden_size=64, n_layer=3, n_head=4, vocab_size=97)],
    "falcon": [dict(NOHEAD), dict(NOHEAD, new_decoder_architecture=True, num_kv_heads=2),
               dict(NOHEAD, multi_query=False, parallel_attn=False, bias=True, alibi=True, tie_word_embeddings=False),
               dict(NOHEAD, new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1,
                    ffn_hidden_size=80)],
    "mpt": [dict(d_model=64, n_layers=3, n_heads=4, vocab_size=97),
            dict(d_model=64, n_layers=3, n_heads=4, vocab_size=97, no_bias=False, expansion_ratio=2)],
    "phi": [dict(NOHEAD, num_key_value_heads=4), dict(NOHEAD, num_key_value_heads=2, qk_layernorm=True,
                                                      partial_rotary_factor=0.4)],
    "persimmon": [dict(NOHEAD), dict(NOHEAD, qk_layernorm=False)],
    "gpt_neox": [dict(NOHEAD),
                 dict(NOHEAD, use_parallel_residual=False, attention_bias=False, tie_word_embeddings=True)],
    "stablelm": [dict(SMALL), dict(SMALL, use_qkv_bias=True, qk_layernorm=True, use_parallel_residual=True,
                                   num_key_value_heads=2)],
    "cohere": [dict(SMALL), dict(SMALL, use_qk_norm=True, num_key_value_heads=2, attention_bias=True)],
    "starcoder2": [dict(SMALL), dict(SMALL, use_bias=False, num_key_value_heads=2)],
    "mixtral": [dict(MOE, num_local_experts=4)],
    "phimoe": [dict(MOE, num_local_experts=4), dict(MOE, num_local_experts=4, lm_head_bias=True, attention_bias=True)],
    "olmoe": [dict(MOE, num_experts=4), dict(MOE, num_experts=4, num_key_value_heads=2)],
    "qwen2_moe": [dict(MOE, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48),
                  dict(MOE, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       decoder_sparse_step=2, mlp_only_layers=[0], num_hidden_layers=5)],
    "qwen3_moe": [dict(MOE, num_experts=4, moe_intermediate_size=32),
                  dict(MOE, num_experts=4, moe_intermediate_size=32, decoder_sparse_step=2, num_hidden_layers=5,
                       attention_bias=True)],
    "deepseek_v2": [dict(MOE, n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=2,
                         first_k_dense_replace=1, q_lora_rank=None, **MLA),
                    dict(MOE, n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1,
                         first_k_dense_replace=0, q_lora_rank=24, attention_bias=True, mlp_bias=True, **MLA)],
    "gpt_oss": [dict(MOE, num_local_experts=4), dict(MOE, num_local_experts=4, attention_bias=False)],
    "deepseek_v3": [dict(MOE, n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1,
                         first_k_dense_replace=1, q_lora_rank=24, n_group=1, topk_group=1, **MLA)],
}
MATRIX = [(t, i, cfg) for t in sorted(KNOWN) for i, cfg in enumerate(
    CASES.get(t, []) + ([dict(SMALL, **f) for f in FLAGS] if t not in CASES
                        else [dict(CASES[t][0], **f) for f in FLAGS[1:3]] if t in LLAMA_LIKE else []))]


@pytest.mark.parametrize("model_type,i,cfg", MATRIX, ids=[f"{t}-{i}" for t, i, _ in MATRIX])
def test_every_known_model_type_matches_transformers(model_type, i, cfg):
    cfg = dict(cfg, model_type=model_type)
    assert from_hf_config(cfg).params() == meta_count(cfg)


def test_missing_fields_take_transformers_defaults():
    """A config.json that leaves a size out gets the config class's default, as transformers would build it."""
    cfg = {k: v for k, v in CONFIGS["mistral-7b"].items() if k not in ("num_key_value_heads", "intermediate_size")}
    shape = from_hf_config(cfg)
    assert (shape.n_kv, shape.d_ff) == (8, 14336)  # MistralConfig's defaults, not heads and 4 × hidden
    assert shape.params() == meta_count(cfg)
    assert any("num_key_value_heads not in the config" in n for n in shape.notes)
    qwen3 = {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 16,
             "num_key_value_heads": 8, "intermediate_size": 3072, "vocab_size": 1000}
    assert from_hf_config(qwen3).d_head == 128 and from_hf_config(qwen3).params() == meta_count(qwen3)


# -- which path counted, and bad input --------------------------------------------------------------------------
def test_text_and_json_say_which_path_counted(tmp_path, capsys):
    main(["estimate", "--config", str(FIX / "configs" / "falcon-7b.json"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == 6_921_720_704 and out["model"]["counted_by"] == "the formula for model_type 'falcon'"
    unknown = dict(CONFIGS["llama-3-8b"], model_type="my_llama")
    (tmp_path / "config.json").write_text(json.dumps(unknown))
    main(["estimate", "--config", str(tmp_path)])
    text = capsys.readouterr().out
    assert "8,030,261,248 parameters" in text and "generic decoder formula" in text and "'my_llama'" in text


@pytest.mark.parametrize("cfg,msg", [
    ({"model_type": "my_model", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10}, "num_hidden_layers"),
    ({"model_type": "t5", "d_model": 512, "num_layers": 6, "num_heads": 8, "vocab_size": 32128}, "not a decoder-only"),
    (dict(SMALL, model_type="llama", num_attention_heads=5, num_key_value_heads=5, head_dim=0), "multiple of heads"),
    (dict(SMALL, model_type="llama", num_key_value_heads=3), "multiple of kv-heads"),
    (dict(SMALL, model_type="llama", hidden_size=-64), "negative"),
    (dict(SMALL, model_type="llama", num_hidden_layers=0), "at least 1"),
    (dict(SMALL, model_type="mixtral", num_local_experts=4, num_experts_per_tok=6), "experts per token"),
    (dict(SMALL, model_type="qwen2_moe", num_experts=4, mlp_only_layers="all"), "mlp_only_layers"),
    (dict(SMALL, model_type="falcon", bias="yes"), "true or false"),
    (dict(SMALL, model_type="llama", intermediate_size=1.5), "whole number"),
])
def test_bad_configs_exit_2_in_one_line(tmp_path, capsys, cfg, msg):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    with pytest.raises(SystemExit) as e:
        main(["estimate", "--config", str(p)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("tracekit: ") and err.count("\n") == 1 and msg in err, err


def active_params(shape) -> int:
    """Parameters one token goes through (MoE: top-k of the routed experts)."""
    if not shape.experts:
        return shape.params()
    f = shape.expert_ffn or shape.d_ff
    per_expert = 3 * shape.hidden * f
    return shape.params() - shape.moe_layers * (shape.experts - shape.top_k) * per_expert
