"""The loader: strict, one error type, messages that name the file and tensor, never half-loaded."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import build_checkpoint
from qwen3_scratch import CheckpointError, ConfigError, load_model


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("pristine"), max_shard_size="40KB")


@pytest.fixture
def sharded(pristine, tmp_path):
    """A fresh copy of a sharded checkpoint that each test may damage."""
    return shutil.copytree(pristine, tmp_path / "ckpt")


def index_of(path):
    return json.loads((path / "model.safetensors.index.json").read_text())


def shard_of(path, tensor="model.layers.1.mlp.down_proj.weight"):
    return path / index_of(path)["weight_map"][tensor]


def test_loads_to_requested_dtype_from_string(sharded):
    model = load_model(sharded, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope_cos.dtype == torch.bfloat16


def test_every_parameter_equals_the_checkpoint_tensor(sharded):
    model = load_model(sharded)
    stored = {}
    for shard in set(index_of(sharded)["weight_map"].values()):
        stored.update(load_file(sharded / shard))
    ours = dict(model.named_parameters())
    assert set(ours) == set(stored), "parameter names must equal the checkpoint's keys"
    for name, tensor in stored.items():
        assert torch.equal(ours[name], tensor), f"{name} differs from the checkpoint"


def test_nothing_is_left_on_the_meta_device(sharded):
    model = load_model(sharded)
    assert all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])


def test_missing_shard_names_the_file(sharded):
    shard = shard_of(sharded)
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name} is missing"):
        load_model(sharded)


def test_truncated_shard_names_the_file(sharded):
    shard = shard_of(sharded)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"{shard.name} is truncated.*down_proj"):
        load_model(sharded)


def test_corrupt_header_names_the_file(sharded):
    shard = shard_of(sharded)
    data = bytearray(shard.read_bytes())
    data[10:20] = b"\xff" * 10
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard.name} has a corrupt"):
        load_model(sharded)


def test_garbage_file_is_not_a_safetensors_file(sharded):
    shard = shard_of(sharded)
    shard.write_bytes(b"\x00" * 7)
    with pytest.raises(CheckpointError, match=f"{shard.name} is too short"):
        load_model(sharded)
    shard.write_bytes(b"<html>Service Unavailable</html>" * 4)
    with pytest.raises(CheckpointError, match=f"{shard.name} is not a safetensors file"):
        load_model(sharded)


def test_git_lfs_pointer_is_recognised(sharded):
    shard = shard_of(sharded)
    shard.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n")
    with pytest.raises(CheckpointError, match=f"{shard.name} is a git-LFS pointer"):
        load_model(sharded)


def test_index_pointing_to_the_wrong_shard(sharded):
    index = index_of(sharded)
    name = "model.layers.1.mlp.down_proj.weight"
    wrong = next(s for s in sorted(set(index["weight_map"].values())) if s != index["weight_map"][name])
    index["weight_map"][name] = wrong
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"index.json: says {name} is in {wrong}"):
        load_model(sharded)


def rewrite_shard(path, tensor, change):
    shard = shard_of(path, tensor)
    tensors = load_file(shard)
    change(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard


def test_shape_contradicting_the_config(sharded):
    name = "model.layers.1.mlp.down_proj.weight"
    shard = rewrite_shard(sharded, name, lambda t: t.update({name: t[name][:, :-1].contiguous()}))
    with pytest.raises(CheckpointError, match=f"{shard.name}: tensor {name} has shape .*config.json implies"):
        load_model(sharded)


def test_config_that_contradicts_the_weights(sharded):
    config = json.loads((sharded / "config.json").read_text())
    config["intermediate_size"] += 8
    (sharded / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="mlp.*shape"):
        load_model(sharded)


def test_dtype_contradicting_the_config(sharded):
    name = "model.layers.1.mlp.down_proj.weight"
    rewrite_shard(sharded, name, lambda t: t.update({name: t[name].to(torch.bfloat16)}))
    with pytest.raises(CheckpointError, match=f"{name} is stored as torch.bfloat16 but config.json says float32"):
        load_model(sharded)


def test_missing_tensor_is_named(sharded):
    name = "model.layers.1.mlp.down_proj.weight"
    rewrite_shard(sharded, name, lambda t: t.pop(name))
    index = index_of(sharded)
    del index["weight_map"][name]
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"no tensor {name}"):
        load_model(sharded)


def test_unexpected_tensor_is_named(sharded):
    name = "model.layers.1.mlp.down_proj.weight"
    rewrite_shard(sharded, name, lambda t: t.update({"model.layers.1.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match="unexpected tensor model.layers.1.mlp.extra.weight"):
        load_model(sharded)


def test_unknown_model_type_is_refused(sharded):
    config = json.loads((sharded / "config.json").read_text())
    config["model_type"] = "mistral"
    (sharded / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="config.json: model_type is 'mistral'"):
        load_model(sharded)


def test_no_weights_at_all(tmp_path, pristine):
    shutil.copy(pristine / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="has neither model.safetensors.*bin weights are not supported"):
        load_model(tmp_path)


def test_missing_folder():
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        load_model("/nonexistent/qwen3")


def test_tied_checkpoint_that_also_saves_lm_head_is_accepted(tmp_path):
    path = build_checkpoint(tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = load_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tensors["lm_head.weight"] += 1.0
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="lm_head.weight differs from the embedding"):
        load_model(path)


def test_untied_checkpoint_without_lm_head_fails(tmp_path):
    path = build_checkpoint(tmp_path, tie_word_embeddings=False)
    tensors = load_file(path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="no tensor lm_head.weight"):
        load_model(path)


def test_unknown_dtype_string():
    with pytest.raises(CheckpointError, match="dtype 'int4'"):
        load_model(".", dtype="int4")
