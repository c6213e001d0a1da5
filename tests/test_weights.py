"""The loader: strict, one error type, messages that name the file and tensor, never half-loaded."""

import json
import re
import shutil
import struct

import pytest
import torch
from checkpoints import build_checkpoint
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

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


# ---- hostile shard headers: the safetensors library's verdict is ours --------------------------


def _header_and_data(shard):
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _write(shard, header=None, data=b"", raw_header=None, length=None):
    raw = raw_header if raw_header is not None else json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def _two_tensors(header):
    """The names of two tensors of this shard, in the order their bytes are stored."""
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    return names[0], names[1]


def _offsets(change):
    """A damage that rewrites the data_offsets of the first two tensors with change(first, second)."""

    def damage(shard):
        header, data = _header_and_data(shard)
        a, b = _two_tensors(header)
        change(header[a], header[b])
        _write(shard, header, data)

    return damage


def _raw_header(edit):
    """A damage that edits the header's JSON text, keeping the data as it was."""

    def damage(shard):
        header, data = _header_and_data(shard)
        _write(shard, raw_header=edit(json.dumps(header)).encode("utf-8", "surrogateescape"), data=data)

    return damage


def _duplicate_first_key(text):
    header = json.loads(text)
    a, b = _two_tensors(header)
    return text.replace(f'"{b}":', f'"{a}":', 1)  # two entries named a: one with a's offsets, one with b's


def _set(field, value, which=0):
    def change(first, second):
        (first, second)[which][field] = value

    return change


HOSTILE_HEADERS = {
    "overlapping-offsets": _offsets(lambda a, b: b.update(data_offsets=[a["data_offsets"][0], b["data_offsets"][1] - (b["data_offsets"][0] - a["data_offsets"][0])])),
    "same-offsets-twice": _offsets(lambda a, b: b.update(data_offsets=a["data_offsets"], shape=a["shape"], dtype=a["dtype"])),
    "negative-offset": _offsets(lambda a, b: a.update(data_offsets=[-4, a["data_offsets"][1]])),
    "gap-between-tensors": _offsets(lambda a, b: b.update(data_offsets=[b["data_offsets"][0] + 4, b["data_offsets"][1] + 4])),
    "end-before-begin": _offsets(lambda a, b: a.update(data_offsets=[a["data_offsets"][1], a["data_offsets"][0]])),
    "float-offsets": _offsets(lambda a, b: a.update(data_offsets=[float(x) for x in a["data_offsets"]])),
    "string-offsets": _offsets(lambda a, b: a.update(data_offsets=[str(x) for x in a["data_offsets"]])),
    "three-offsets": _offsets(lambda a, b: a.update(data_offsets=a["data_offsets"] + [0])),
    "offset-past-end": _offsets(lambda a, b: b.update(data_offsets=[b["data_offsets"][0], 10**12])),
    "float-shape": _offsets(_set("shape", [1.5])),
    "string-shape": _offsets(lambda a, b: a.update(shape=[str(x) for x in a["shape"]])),
    "negative-shape": _offsets(lambda a, b: a.update(shape=[-x for x in a["shape"]])),
    "shape-size-mismatch": _offsets(lambda a, b: a.update(shape=[*a["shape"], 2])),
    "shape-overflow": _offsets(_set("shape", [2**62, 2**62])),
    "bad-dtype": _offsets(_set("dtype", "Q4_K")),
    "no-dtype": _offsets(lambda a, b: a.pop("dtype")),
    "entry-not-a-dict": _offsets(lambda a, b: (a.clear(), a.update(x=1))),
    "duplicate-key": _raw_header(_duplicate_first_key),
    "header-a-list": _raw_header(lambda text: "[" + text + "]"),
    "header-a-string": _raw_header(lambda text: json.dumps(text)),
    "header-not-utf8": _raw_header(lambda text: text.replace("model", "m\udcffdel", 1)),
    "header-nested-deeply": _raw_header(lambda text: text[:-1] + ', "x": ' + "[" * 10_000 + "]" * 10_000 + "}"),
    "metadata-not-strings": _raw_header(lambda text: text.replace('"__metadata__": {"format": "pt"}', '"__metadata__": {"format": 1}')),
    "header-length-huge": lambda shard: shard.write_bytes(struct.pack("<Q", 2**63) + shard.read_bytes()[8:]),
    "header-length-past-the-file": lambda shard: shard.write_bytes(struct.pack("<Q", shard.stat().st_size) + shard.read_bytes()[8:]),
    "trailing-bytes": lambda shard: shard.write_bytes(shard.read_bytes() + b"\0" * 64),
    "truncated-data": lambda shard: shard.write_bytes(shard.read_bytes()[:-4]),
}


@pytest.mark.parametrize("damage", HOSTILE_HEADERS.values(), ids=HOSTILE_HEADERS.keys())
def test_hostile_shard_header_is_refused_as_the_safetensors_library_refuses_it(sharded, damage):
    shards = sorted(set(index_of(sharded)["weight_map"].values()))
    shard = next(sharded / s for s in shards if len(_header_and_data(sharded / s)[0]) > 2)  # >= 2 tensors
    damage(shard)
    with pytest.raises(SafetensorError):  # the reference reader's verdict...
        with safe_open(shard, framework="pt") as f:
            [f.get_tensor(k) for k in f.keys()]
    with pytest.raises(CheckpointError, match=re.escape(shard.name)) as error:  # ...is ours, naming the file
        load_model(sharded)
    assert "\n" not in str(error.value)


def test_weights_are_views_of_the_mapped_file_not_copies(sharded):
    """On CPU in the stored dtype a parameter is the file's bytes, mapped: no second copy in RAM."""
    model = load_model(sharded, dtype="float32")
    for name, param in model.named_parameters():
        storage = param.untyped_storage()
        assert storage.nbytes() <= param.numel() * param.element_size() + 64, f"{name} holds more than its bytes"
        assert not storage.resizable(), f"{name} is an ordinary allocation, not a view of the mapped shard"
