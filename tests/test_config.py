"""config.json -> Qwen3Config, in both layouts found in the wild, and refusals of what we don't implement."""

import json

import pytest
import torch

from qwen3_scratch import ConfigError, Qwen3Config

# Qwen3-0.6B's config.json as the Hub ships it.
HUB_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def transformers5_layout(raw):
    raw = dict(raw)
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": raw.pop("rope_theta")}
    raw.pop("rope_scaling")
    raw["dtype"] = raw.pop("torch_dtype")
    return raw


def test_hub_config_of_qwen3_0_6b():
    config = Qwen3Config.from_dict(HUB_0_6B)
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (1024, 28, 128)
    assert config.num_attention_heads * config.head_dim == 2048, "q_proj of 0.6B is 1024 -> 2048"
    assert config.kv_groups == 2
    assert config.rope_theta == 1e6 and config.rope_scaling is None
    assert config.tie_word_embeddings and config.dtype == torch.bfloat16
    assert config.eos_token_ids == [151645]


def test_both_layouts_give_the_same_config():
    assert Qwen3Config.from_dict(HUB_0_6B) == Qwen3Config.from_dict(transformers5_layout(HUB_0_6B))


def test_yarn_in_both_layouts():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    hub = {**HUB_0_6B, "rope_scaling": yarn}
    t5 = transformers5_layout(HUB_0_6B)
    t5["rope_parameters"] = {**yarn, "rope_theta": 1000000}
    for raw in (hub, t5):
        config = Qwen3Config.from_dict(raw)
        assert config.rope_scaling.factor == 4.0
        assert config.rope_scaling.original_max_position_embeddings == 32768
        assert config.rope_theta == 1e6


def test_from_json_reads_a_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HUB_0_6B))
    assert Qwen3Config.from_json(tmp_path).vocab_size == 151936


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "llama"}, "model_type"),
        ({"model_type": "qwen3_moe"}, "num_experts"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope type 'linear'"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
        ({"rope_scaling": {"rope_type": "yarn"}}, "factor"),
        ({"use_sliding_window": True}, "sliding"),
        ({"num_key_value_heads": 5}, "multiple"),
        ({"torch_dtype": "int8"}, "dtype"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        Qwen3Config.from_dict({**HUB_0_6B, **change})


def test_missing_key_names_the_key():
    raw = dict(HUB_0_6B)
    del raw["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        Qwen3Config.from_dict(raw)


def test_missing_or_broken_config_json_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        Qwen3Config.from_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json.*not valid JSON"):
        Qwen3Config.from_json(tmp_path)
