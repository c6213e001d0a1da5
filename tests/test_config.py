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


# ---- config.json is untrusted: every field's type and range --------------------------------

from dataclasses import fields  # noqa: E402

from qwen3_scratch.model.config import CONFIG_RULES, SPECIAL_FIELDS, YARN_RULES, RopeScaling  # noqa: E402

YARN_1M = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144}
# Qwen3-235B-A22B's sizes (as a dense config: we check only the shared fields) with a 1M-token YaRN context.
LARGEST = {**HUB_0_6B, "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
           "num_key_value_heads": 4, "intermediate_size": 12288, "max_position_embeddings": 1048576,
           "rope_scaling": YARN_1M}  # fmt: skip

BAD_VALUES = [
    ("hidden_size", "64"), ("hidden_size", 64.0), ("hidden_size", True), ("hidden_size", -64), ("hidden_size", 0),
    ("hidden_size", 2**40), ("vocab_size", 10**9), ("vocab_size", [1]), ("intermediate_size", -1),
    ("num_hidden_layers", 10**7), ("num_hidden_layers", 0), ("num_hidden_layers", "28"),
    ("num_attention_heads", 0), ("num_attention_heads", 10**6), ("num_key_value_heads", 0), ("num_key_value_heads", -8),
    ("head_dim", 0), ("head_dim", 1), ("head_dim", 2**20), ("head_dim", 127.5),
    ("max_position_embeddings", 10**8), ("max_position_embeddings", 0), ("max_position_embeddings", "40960"),
    ("rope_theta", 0), ("rope_theta", -1e6), ("rope_theta", 1), ("rope_theta", float("nan")), ("rope_theta", float("inf")),
    ("rope_theta", "1e6"), ("rms_norm_eps", -1e-6), ("rms_norm_eps", 0), ("rms_norm_eps", float("nan")), ("rms_norm_eps", 2),
    ("tie_word_embeddings", "false"), ("tie_word_embeddings", 1), ("attention_bias", "no"),
    ("eos_token_id", 151936), ("eos_token_id", -1), ("eos_token_id", "151645"), ("eos_token_id", 1.5),
    ("eos_token_id", [151645, 10**9]), ("eos_token_id", {"a": 1}), ("bos_token_id", 10**9), ("bos_token_id", True),
    ("torch_dtype", ["bfloat16"]), ("torch_dtype", "int4"),
    ("rope_scaling", {**YARN_1M, "factor": 0.5}), ("rope_scaling", {**YARN_1M, "factor": "4"}),
    ("rope_scaling", {**YARN_1M, "factor": float("inf")}), ("rope_scaling", {**YARN_1M, "factor": 10**6}),
    ("rope_scaling", {**YARN_1M, "original_max_position_embeddings": 0}),
    ("rope_scaling", {**YARN_1M, "original_max_position_embeddings": 32768.5}),
    ("rope_scaling", {**YARN_1M, "beta_fast": -32}), ("rope_scaling", {**YARN_1M, "beta_slow": 0}),
    ("rope_scaling", {**YARN_1M, "attention_factor": -1}), ("rope_scaling", {**YARN_1M, "truncate": "yes"}),
    ("rope_scaling", [1, 2]), ("rope_scaling", "yarn"), ("rope_scaling", {"rope_type": ["yarn"]}),
]


@pytest.mark.parametrize("key, value", BAD_VALUES, ids=[f"{k}={v!r}"[:40] for k, v in BAD_VALUES])
def test_field_of_wrong_type_or_range_is_refused_naming_the_field(key, value):
    field = {"torch_dtype": "dtype", "rope_scaling": ""}.get(key, key)
    with pytest.raises(ConfigError, match=f"^config.json: .*{field}") as error:
        Qwen3Config.from_dict({**HUB_0_6B, key: value})
    assert "\n" not in str(error.value)


def test_the_largest_qwen3_and_a_1m_token_yarn_context_are_accepted():
    config = Qwen3Config.from_dict(LARGEST)
    assert config.max_position_embeddings == 2**20 and config.rope_scaling.factor == 4.0
    assert isinstance(config.rope_theta, float) and config.rope_theta == 1e6


def test_every_config_field_has_a_rule():
    """A new field (the MoE ones, say) must get a line in CONFIG_RULES, or be checked by hand."""
    names = {f.name for f in fields(Qwen3Config)}
    assert names == set(CONFIG_RULES) | SPECIAL_FIELDS, f"fields without a rule: {names - set(CONFIG_RULES) - SPECIAL_FIELDS}"
    assert {f.name for f in fields(RopeScaling)} == set(YARN_RULES) | {"attention_factor"}


def test_hostile_config_json_files_are_refused_naming_the_file(tmp_path):
    path = tmp_path / "config.json"
    for text, needle in [
        ("[" * 100_000, "nested too deeply"),
        ('{"vocab_size": 1' + "0" * 5000 + "}", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"model_type": "qwen3\x1b[31m"}), "qwen3\\\\x1b\\[31m"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=needle) as error:
            Qwen3Config.from_json(path)
        assert "config.json" in str(error.value) and "\x1b" not in str(error.value)
    path.write_bytes(b'{"model_type": "\xff"}')
    with pytest.raises(ConfigError, match="config.json is not UTF-8"):
        Qwen3Config.from_json(path)
