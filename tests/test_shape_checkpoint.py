"""scripts/checkpoints/make_shape_checkpoint.py: Hub layout, true Qwen3 facts, and a checkpoint both loaders agree on.

The weights are written through the same code path as the real sizes, only shrunk by `overrides`,
with a shard size small enough to force several shards and an index.
"""

import json
import math

import pytest
import torch
import transformers
from checkpoints import assert_logits_match
from make_shape_checkpoint import generation_config, make_shape_checkpoint, plan_shards, shape_config, tensor_shapes
from safetensors import safe_open

from qwen3_scratch import load_model
from qwen3_scratch.model.sizes import QWEN3_SIZES, parameter_count

# GQA (4 query heads, 2 kv heads) and head_dim 32 != hidden / heads, like the real shapes.
SMALL = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=128,
    bos_token_id=380,  # inside the small vocabulary, so transformers does not warn
    eos_token_id=381,
)
TINY_SHARD_GB = 60e3 / 1e9  # 60 kB: the fp32 embedding (98 kB) gets a shard of its own, layers share


def write_small(path, tied=True, **kwargs):
    overrides = {**SMALL, "tie_word_embeddings": tied}
    return make_shape_checkpoint("0.6B", path, dtype="float32", overrides=overrides, **kwargs)


def stored_tensors(folder):
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            assert f.metadata() == {"format": "pt"}, f"{file.name}: the Hub's files carry metadata format=pt"
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_sharded_checkpoint_has_the_hub_layout(tmp_path, tied):
    out = write_small(tmp_path / "ckpt", tied=tied, max_shard_size_gb=TINY_SHARD_GB)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    n = len(shards)
    assert n > 2, "a 60 kB shard size must split this checkpoint into several shards"
    assert shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards, "no stray or missing shard files"
    assert not (out / "model.safetensors").exists()

    tensors = stored_tensors(out)
    expected = tensor_shapes(json.loads((out / "config.json").read_text()))
    assert set(index["weight_map"]) == set(tensors) == set(expected)
    assert ("lm_head.weight" in tensors) == (not tied), "lm_head.weight is stored only when untied"
    assert all(tuple(tensors[k].shape) == shape for k, shape in expected.items()), "Linear weights are (out, in)"
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    norm = tensors["model.layers.0.input_layernorm.weight"]
    assert (norm - 1).abs().max() > 0.01, "norm weights must not be exactly 1 (that hides a missing multiply)"


def test_checkpoint_that_fits_one_shard_is_a_single_file(tmp_path):
    out = write_small(tmp_path / "ckpt")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "float32" and config["hidden_size"] == 64
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [381, 380], "a turn ends at <|im_end|>, a document at <|endoftext|>"


def test_generation_config_is_qwen3s():
    assert generation_config(shape_config("0.6B")) == {
        "bos_token_id": 151643,
        "do_sample": True,
        "eos_token_id": [151645, 151643],
        "pad_token_id": 151643,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }


def test_weights_do_not_depend_on_the_shard_size(tmp_path):
    single = stored_tensors(write_small(tmp_path / "single", seed=3))
    sharded = stored_tensors(write_small(tmp_path / "sharded", seed=3, max_shard_size_gb=TINY_SHARD_GB))
    assert all(torch.equal(single[k], sharded[k]) for k in single), "same seed must give the same weights"


def test_tied_head_copy_equals_the_embedding(tmp_path):
    tensors = stored_tensors(write_small(tmp_path / "ckpt", tied_head_copy=True, max_shard_size_gb=TINY_SHARD_GB))
    assert torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])


def test_complete_checkpoint_is_not_rewritten(tmp_path):
    out = write_small(tmp_path / "ckpt")
    before = (out / "model.safetensors").stat().st_mtime_ns
    write_small(tmp_path / "ckpt")
    assert (out / "model.safetensors").stat().st_mtime_ns == before, "a complete checkpoint must be kept"
    write_small(tmp_path / "ckpt", force=True, max_shard_size_gb=TINY_SHARD_GB)
    assert not (out / "model.safetensors").exists(), "force must rewrite, and remove the old layout's files"


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_our_loader_and_transformers_give_the_same_logits(tmp_path, tied):
    out = write_small(tmp_path / "ckpt", tied=tied, max_shard_size_gb=TINY_SHARD_GB)
    ours = load_model(out, dtype="float32")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = theirs(ids).logits
    assert_logits_match(ours(ids), expected, "shape checkpoint")


def test_default_config_has_the_true_qwen3_0_6b_facts():
    config = shape_config("0.6B")  # config only: no weights written
    facts = dict(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        vocab_size=151936,
        torch_dtype="bfloat16",
        model_type="qwen3",
    )
    assert {k: config[k] for k in facts} == facts
    shapes = tensor_shapes(config)
    assert len(shapes) == 310 and "lm_head.weight" not in shapes
    assert sum(math.prod(s) for s in shapes.values()) == parameter_count("0.6B") == 596_049_920


@pytest.mark.parametrize("size, hub_shards", [("0.6B", 1), ("4B", 3), ("8B", 5), ("14B", 8), ("32B", 17)])
def test_shard_plan_matches_the_hub_file_count(size, hub_shards):
    config = shape_config(size)
    shapes = tensor_shapes(config)
    assert ("lm_head.weight" in shapes) == (not QWEN3_SIZES[size]["tie_word_embeddings"])
    assert len(plan_shards(shapes, 2, 4 * 10**9)) == hub_shards


def test_tied_head_copy_reproduces_the_hub_0_6b_file_size():
    # The Hub's Qwen3-0.6B model.safetensors stores lm_head.weight too: 311 tensors, 1,503,264,768
    # bytes of tensor data. With the copy, the 1.7B needs two 4 GB shards, as on the Hub.
    shapes = tensor_shapes(shape_config("0.6B"), tied_head_copy=True)
    assert len(shapes) == 311
    assert 2 * sum(math.prod(s) for s in shapes.values()) == 1_503_264_768
    assert len(plan_shards(tensor_shapes(shape_config("1.7B"), tied_head_copy=True), 2, 4 * 10**9)) == 2
