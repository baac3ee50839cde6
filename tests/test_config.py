"""ModelConfig mapping from HF configs, validation, and full-size presets through eval_shape."""
import json

import pytest

from glint.model import transformer
from glint.model.config import ModelConfig, RopeConfig
from glint.model.presets import KNOWN_PARAMS, PRESETS, preset


def hf_config(hf_fixture) -> dict:
    return json.loads((hf_fixture / "config.json").read_text())


def test_from_hf_reads_every_fixture(hf_fixture):
    c = hf_config(hf_fixture)
    cfg = ModelConfig.from_hf(hf_fixture)
    assert cfg.num_layers == c["num_hidden_layers"] and cfg.vocab_size == c["vocab_size"]
    assert cfg.num_kv_heads == c["num_key_value_heads"]
    windows = [w for w in cfg.layer_windows if w]
    assert all(w == c["sliding_window"] for w in windows)
    for kind, window in zip(c.get("layer_types") or [], cfg.layer_windows):
        assert (kind == "sliding_attention") == (window > 0)
    assert ModelConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2"}, "model_type 'gpt2'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type 'yarn'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mscale": 2.0}}, "mscale"),
    ({"hidden_act": "relu"}, "activation 'relu'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"num_key_value_heads": 3}, "num_kv_heads 3"),
    ({"layer_types": ["full_attention", "chunked_attention", "full_attention"]}, "chunked_attention"),
])
def test_from_hf_rejects_what_we_do_not_implement(change, message):
    base = {"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**base, **change})


def test_old_style_rope_scaling_and_top_level_theta():
    cfg = ModelConfig.from_hf({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
                               "num_attention_heads": 2, "intermediate_size": 16, "rope_theta": 5e5,
                               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert cfg.layer_rope[0] == RopeConfig(5e5, "llama3", 8.0, 1.0, 4.0, 8192)
    assert cfg.head_dim == 4 and cfg.num_kv_heads == 2


def test_validation_names_the_value():
    with pytest.raises(ValueError, match="hidden_size must be a positive int, got 0"):
        preset("tiny").replace(hidden_size=0)
    with pytest.raises(ValueError, match="layer_windows has 1 entries for 2 layers"):
        preset("tiny").replace(layer_windows=(0,))
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        preset("nope")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_eval_shape(name):
    cfg = preset(name)
    params = transformer.split(transformer.abstract_model(cfg))[1]
    count = transformer.count_params(params)
    print(f"{name}: {count:,} parameters")
    assert count == cfg.num_params
    if name in KNOWN_PARAMS:
        assert count == KNOWN_PARAMS[name]
    small = cfg.replace(num_layers=2)
    assert small.layer_windows == cfg.layer_windows[:2]


def test_glimmer_layout():
    cfg = preset("muse-glimmer-30b")
    assert cfg.layer_windows[:4] == (2048, 2048, 2048, 0) and cfg.layer_rope[3] is None
    assert cfg.layer_rope[0].theta == 5e5 and cfg.final_softcap == 20.0
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (32, 2, 128, 19968)
    assert cfg.qk_norm == "rms_scaleless" and cfg.attn_output_gate and cfg.embed_norm and cfg.norm_delta
