"""scripts/checkpoints/make_tiny_checkpoint.py writes a checkpoint that transformers loads like a Hub download."""

import json
import subprocess
import sys
import time
from pathlib import Path

import make_tiny_checkpoint
import pytest
import torch
import transformers
from make_tiny_checkpoint import make_tiny_checkpoint as make
from safetensors import safe_open

SCRIPT = Path(make_tiny_checkpoint.__file__)
EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors.index.json",
    "model-00001-of-00003.safetensors",
    "model-00002-of-00003.safetensors",
    "model-00003-of-00003.safetensors",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make(tmp_path_factory.mktemp("tiny-qwen3"))


def read_json(path):
    return json.loads(path.read_text(encoding="utf-8"))


def read_shards(folder):
    """{tensor name: (shard file name, tensor)} over every shard in the folder."""
    tensors = {}
    for shard in sorted(folder.glob("model-*.safetensors")):
        with safe_open(shard, framework="pt") as handle:
            assert handle.metadata() == {"format": "pt"}, f"{shard.name} lacks the Hub's format metadata"
            for name in handle.keys():
                assert name not in tensors, f"{name} is stored in two shards"
                tensors[name] = (shard.name, handle.get_tensor(name))
    return tensors


def test_writes_every_checkpoint_file_quickly(tmp_path):
    start = time.perf_counter()
    out = make(tmp_path / "ckpt")
    elapsed = time.perf_counter() - start
    assert out == tmp_path / "ckpt"
    written = {p.name for p in out.iterdir()}
    assert written == EXPECTED_FILES, f"expected {sorted(EXPECTED_FILES)}, wrote {sorted(written)}"
    assert elapsed < 5, f"writing the tiny checkpoint took {elapsed:.1f}s; it should take well under a second"


def test_index_names_every_shard_and_every_tensor_once(checkpoint):
    index = read_json(checkpoint / "model.safetensors.index.json")
    tensors = read_shards(checkpoint)
    assert len({name for name in index["weight_map"].values()}) >= 2, "the checkpoint should be sharded"
    for shard in set(index["weight_map"].values()):
        assert (checkpoint / shard).is_file(), f"the index names {shard}, which was not written"
    assert index["weight_map"] == {name: shard for name, (shard, _) in tensors.items()}, (
        "the index must map each tensor to the shard that really holds it, and list every tensor"
    )
    total = sum(t.numel() * t.element_size() for _, t in tensors.values())
    assert index["metadata"]["total_size"] == total, "metadata.total_size must be the tensors' bytes"


def test_weights_are_bf16_with_hf_names_and_tied_embeddings(checkpoint):
    tensors = {name: t for name, (_, t) in read_shards(checkpoint).items()}
    config = read_json(checkpoint / "config.json")
    assert "lm_head.weight" not in tensors, "tied embeddings: the Hub stores no lm_head"
    assert all(t.dtype == torch.bfloat16 for t in tensors.values()), "weights must be stored in bf16, like the Hub"
    assert tensors["model.embed_tokens.weight"].shape == (config["vocab_size"], config["hidden_size"])
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (config["num_attention_heads"] * config["head_dim"], config["hidden_size"]), "Linear is (out, in)"
    norm = tensors["model.norm.weight"].float()
    assert (norm - 1).abs().max() < 0.6 and norm.std() > 0, "norm weights should be near 1 but not all equal"


def test_config_is_in_the_hub_qwen3_layout(checkpoint):
    config = read_json(checkpoint / "config.json")
    tokenizer_size = make_tiny_checkpoint.train_tiny_tokenizer().get_vocab_size(with_added_tokens=True)
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["rope_scaling"] is None and "rope_theta" in config and config["torch_dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is True and config["use_sliding_window"] is False
    assert config["num_attention_heads"] > config["num_key_value_heads"], "the tiny model must exercise GQA"
    assert config["vocab_size"] % 64 == 0 and tokenizer_size <= config["vocab_size"] < tokenizer_size + 64


def test_generation_config_has_qwen3_sampling_defaults(checkpoint):
    generation = read_json(checkpoint / "generation_config.json")
    tokenizer_config = read_json(checkpoint / "tokenizer_config.json")
    ids = {token["content"]: int(i) for i, token in tokenizer_config["added_tokens_decoder"].items()}
    assert generation["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]], "chat and document ends both stop"
    assert generation["pad_token_id"] == ids["<|endoftext|>"]
    assert (generation["temperature"], generation["top_k"], generation["top_p"]) == (0.6, 20, 0.95)


def test_transformers_loads_the_model_and_tokenizer(checkpoint):
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.dtype == torch.bfloat16
    ours = {name: t for name, (_, t) in read_shards(checkpoint).items()}
    theirs = model.state_dict()
    assert set(theirs) - set(ours) == {"lm_head.weight"}, f"key names differ: {set(theirs) ^ set(ours)}"
    for name, tensor in ours.items():
        assert torch.equal(theirs[name], tensor), f"transformers loaded {name} with different values"
    assert torch.equal(theirs["lm_head.weight"], ours["model.embed_tokens.weight"]), "lm_head must be tied"
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    assert type(tokenizer).__name__ == "Qwen2Tokenizer", "the folder must load as Qwen3's own tokenizer class"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"


def test_same_seed_same_checkpoint_other_seed_other_weights(tmp_path):
    a, b, c = (make(tmp_path / name, seed=seed) for name, seed in [("a", 0), ("b", 0), ("c", 1)])
    for name in EXPECTED_FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), f"{name} differs between two runs with one seed"
    shard = "model-00001-of-00003.safetensors"
    assert (a / shard).read_bytes() != (c / shard).read_bytes(), "the seed must change the weights"


def test_script_does_not_import_transformers(tmp_path):
    """A new user may not have transformers: writing the checkpoint must not import it, even indirectly."""
    code = (
        f"import sys; sys.path.insert(0, {str(SCRIPT.parent)!r}); import make_tiny_checkpoint; "
        f"make_tiny_checkpoint.make_tiny_checkpoint({str(tmp_path / 'out')!r}); print('transformers' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", "make_tiny_checkpoint pulled in transformers"


def test_runs_as_a_script_with_out(tmp_path):
    out = tmp_path / "from-cli"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"the script failed:\n{result.stderr}"
    assert str(out) in result.stdout, f"the script must say where it wrote: {result.stdout!r}"
    assert {p.name for p in out.iterdir()} == EXPECTED_FILES
