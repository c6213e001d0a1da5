"""Load a Hugging Face Qwen3 checkpoint straight into our model.

The model is built on the `meta` device (shapes only, no memory), then each shard is memory-mapped
and every parameter becomes a view of its bytes in the file: on CPU in the stored dtype nothing is
copied at all (the OS pages weights in as they are used, and they count once, as page cache); for
another dtype or a GPU each tensor is cast/copied from the mapping straight into its final place.
Either way there is never a full second copy of the model in RAM. (A mapped file must not be
rewritten in place while the model lives; replacing it, as a download does, is safe.) Everything is checked *before* any data is read (every shard
present and whole, every parameter named exactly once, shapes and dtypes as config.json says), so a
bad checkpoint fails with one CheckpointError naming the file and the tensor, never half-loaded.

A safetensors file is: 8 bytes (little-endian u64 N), N bytes of JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}}, then the raw tensor bytes.
"""

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .config import DTYPES, Qwen3Config
from .errors import CheckpointError
from .fuse import fuse_projections, prepack_for_cpu
from .model import Qwen3
from .quantize import SCHEMES, quantize_model

SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
LFS_POINTER_PREFIX = b"version https://git-lfs"
MAX_HEADER_BYTES = 100 * 1024 * 1024
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass
class TensorEntry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in the file
    nbytes: int


class DamagedFile(CheckpointError):
    """A weight file that is missing, cut short, or not a safetensors file at all."""

    def __init__(self, file: Path, problem: str):
        self.file, self.problem = file, problem  # problem reads after the name: "is truncated (...)"
        super().__init__(f"{file} {problem}; download it again")


def read_raw_header(file: Path) -> tuple[dict, int]:
    """(the JSON header, the byte where tensor data starts), after checking the file is whole.

    Only the structure is judged here (present, not a git-LFS pointer, a sane header, long enough for
    every tensor it lists), so the Hub download can use it to find files worth fetching again.
    """
    if not file.is_file():
        raise DamagedFile(file, "is missing")
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            header, header_len = _parse_header(file, f, size)
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read ({e.strerror}); check the path and permissions") from e
    ends = {name: int(info["data_offsets"][1]) for name, info in header.items()}
    data_start = 8 + header_len
    if ends and data_start + max(ends.values()) > size:
        last = max(ends, key=ends.get)
        raise DamagedFile(file, f"is truncated ({size} bytes, but tensor {last} ends at byte {data_start + ends[last]})")
    return header, data_start


def _parse_header(file: Path, f, size: int) -> tuple[dict, int]:
    """The JSON header (without __metadata__) and its length in bytes, or DamagedFile."""
    head = f.read(len(LFS_POINTER_PREFIX))
    if head == LFS_POINTER_PREFIX:
        raise DamagedFile(file, "is a git-LFS pointer, not the weights (the repo was cloned without git-lfs)")
    if len(head) < 8:
        raise DamagedFile(file, "is empty" if size == 0 else "is too short to be a safetensors file")
    (header_len,) = struct.unpack("<Q", head[:8])
    if header_len > min(MAX_HEADER_BYTES, size - 8):
        raise DamagedFile(file, "is not a safetensors file (bad header length)")
    f.seek(8)
    try:
        header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        for info in header.values():  # the offsets must be there and be numbers
            int(info["data_offsets"][1])
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise DamagedFile(file, "has a corrupt safetensors header") from e
    return header, header_len


def read_safetensors_header(file: Path) -> dict[str, TensorEntry]:
    """Parse and validate one shard's header; nothing of the tensor data is read."""
    header, data_start = read_raw_header(file)
    return {name: _entry(file, name, info, data_start) for name, info in header.items()}


def _entry(file: Path, name: str, info: dict, data_start: int) -> TensorEntry:
    if info.get("dtype") not in SAFETENSORS_DTYPES:
        raise CheckpointError(
            f"{file}: tensor {name} has dtype {info.get('dtype')}; only BF16/F16/F32 weights are supported "
            "(quantized checkpoints are not)"
        )
    dtype, shape = SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"])
    begin, end = info["data_offsets"]
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise CheckpointError(f"{file}: tensor {name} header says {end - begin} bytes for shape {shape}; corrupt file")
    return TensorEntry(file, dtype, shape, data_start + begin, nbytes)


def checkpoint_files(folder: Path) -> list[Path]:
    """The weight files: those named by model.safetensors.index.json, or the single model.safetensors.

    Whether each is present and whole is for read_raw_header to say.
    """
    index = folder / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return [folder / name for name in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index (no weight_map); download it again") from e
    if (folder / SINGLE_FILE).exists():
        return [folder / SINGLE_FILE]
    hint = " (pytorch .bin weights are not supported)" if any(folder.glob("*.bin")) else ""
    raise CheckpointError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}; download the checkpoint again")


def read_checkpoint_index(folder: Path) -> dict[str, TensorEntry]:
    """Every tensor in the checkpoint -> where it lives, checked against the index json."""
    entries: dict[str, TensorEntry] = {}
    for file in checkpoint_files(folder):
        for name, entry in read_safetensors_header(file).items():
            if name in entries:
                raise CheckpointError(f"{file}: tensor {name} is also in {entries[name].file.name}; corrupt checkpoint")
            entries[name] = entry
    index = folder / INDEX_FILE
    if index.exists():
        for name, shard in json.loads(index.read_text())["weight_map"].items():
            if name not in entries or entries[name].file.name != shard:
                found = entries[name].file.name if name in entries else "no shard"
                raise CheckpointError(
                    f"{index}: says {name} is in {shard}, but it is in {found}; download the checkpoint again"
                )
    return entries


def split_fused_experts(entries: dict[str, TensorEntry], config: Qwen3Config) -> dict[str, TensorEntry]:
    """Checkpoint tensors -> model parameters, for MoE checkpoints written in transformers 5's fused layout.

    The Hub's Qwen3-MoE repos store each expert's weights under its own keys, which are our parameter
    names. transformers 5 holds (and, with save_pretrained(save_original_format=False), writes) each
    layer's experts as two stacked tensors instead:
        mlp.experts.gate_up_proj (E, 2I, C): expert e's gate_proj rows then its up_proj rows
        mlp.experts.down_proj    (E, C, I)
    Each expert's slice of those is a contiguous run of bytes, so it becomes an entry of its own that
    points into the same file: loading stays a per-parameter view of the mapping, with no copy.
    The fused tensors' shape and dtype are checked here, so errors name the checkpoint's own keys.
    """
    fused = [name for name in entries if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]
    if not fused:
        return entries
    entries = dict(entries)
    E, I, C = config.num_experts, config.moe_intermediate_size, config.hidden_size
    for name in fused:
        entry = entries.pop(name)
        prefix, _, kind = name.rpartition(".")  # "model.layers.N.mlp.experts", "gate_up_proj" | "down_proj"
        expected = (E, 2 * I, C) if kind == "gate_up_proj" else (E, C, I)
        if entry.shape != expected or entry.dtype != config.dtype:
            raise CheckpointError(
                f"{entry.file}: tensor {name} is {entry.dtype} {list(entry.shape)} but config.json implies "
                f"{config.dtype} {list(expected)}; the config and the weights are from different models"
            )
        parts = ["gate_proj", "up_proj"] if kind == "gate_up_proj" else ["down_proj"]
        part_shape = (I, C) if kind == "gate_up_proj" else (C, I)
        part_bytes = I * C * entry.dtype.itemsize
        for e in range(E):
            for j, part in enumerate(parts):
                key = f"{prefix}.{e}.{part}.weight"
                if key in entries:
                    raise CheckpointError(f"{entry.file}: {key} is stored both on its own and inside {name}")
                start = entry.start + (e * len(parts) + j) * part_bytes
                entries[key] = TensorEntry(entry.file, entry.dtype, part_shape, start, part_bytes)
    return entries


def _check_expert_count(entries: dict[str, TensorEntry], config: Qwen3Config) -> None:
    """A checkpoint with more or fewer experts than config.json says, named as such."""
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}.mlp.experts."
        stored = {name[len(prefix) :].split(".")[0] for name in entries if name.startswith(prefix)}
        expected = config.num_experts if config.is_moe_layer(i) else 0
        if stored and len(stored) != expected:
            file = next(entries[name].file for name in entries if name.startswith(prefix))
            raise CheckpointError(
                f"{file}: layer {i} has {len(stored)} experts but config.json implies {expected} "
                "(num_experts, decoder_sparse_step, mlp_only_layers); the config and the weights are from "
                "different models"
            )


def _check_matches_model(entries: dict[str, TensorEntry], model: Qwen3, config: Qwen3Config) -> None:
    """Every parameter present once with the config's shape and dtype; nothing unexpected."""
    expected = dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens
    for name, param in expected.items():
        if name not in entries:
            raise CheckpointError(f"checkpoint has no tensor {name}, which config.json implies; wrong or partial files?")
        entry = entries[name]
        if entry.shape != tuple(param.shape):
            raise CheckpointError(
                f"{entry.file}: tensor {name} has shape {list(entry.shape)} but config.json implies "
                f"{list(param.shape)}; the config and the weights are from different models"
            )
        if entry.dtype != config.dtype:
            raise CheckpointError(
                f"{entry.file}: tensor {name} is stored as {entry.dtype} but config.json says {config.torch_dtype}"
            )
    unexpected = sorted(set(entries) - set(expected) - {"lm_head.weight"})
    if unexpected:
        raise CheckpointError(
            f"{entries[unexpected[0]].file}: unexpected tensor {unexpected[0]} (+{len(unexpected) - 1} more); "
            "not a Qwen3 checkpoint matching this config.json"
        )
    if "lm_head.weight" in entries and "lm_head.weight" not in expected:  # tied, but saved anyway
        if entries["lm_head.weight"].shape != entries["model.embed_tokens.weight"].shape:
            raise CheckpointError(f"{entries['lm_head.weight'].file}: lm_head.weight has the wrong shape")


def map_shard(file: Path) -> torch.Tensor:
    """The whole file as a uint8 tensor backed by a private memory map: no bytes are read yet."""
    storage = torch.UntypedStorage.from_file(str(file), shared=False, nbytes=file.stat().st_size)
    return torch.tensor([], dtype=torch.uint8).set_(storage)


def tensor_from_map(shard: torch.Tensor, entry: TensorEntry, device, dtype) -> torch.Tensor:
    """One tensor as a view of the mapped shard, then moved/cast (a no-op on CPU in the stored dtype)."""
    raw = shard[entry.start : entry.start + entry.nbytes]
    if entry.start % entry.dtype.itemsize:  # a view needs aligned data; safetensors aligns, but be safe
        raw = raw.clone()
    return raw.view(entry.dtype).view(entry.shape).to(device=device, dtype=dtype)


def load_model(path, device="cpu", dtype=torch.float32, optimize=False, quantize=None) -> Qwen3:
    """Build Qwen3 from a checkpoint folder; returns the model in eval mode on `device` in `dtype`.

    optimize: after the strict load, fuse q/k/v and gate/up and prepack the matrices for the CPU's
        matmul library (fuse.py): faster decode, logits equal up to float rounding.
    quantize: "int8" stores every matrix as int8 with per-row scales computed now (quantize.py).
    """
    if quantize is not None and quantize not in SCHEMES:
        raise CheckpointError(f"--quantize {quantize!r} is not supported; use one of {', '.join(SCHEMES)}")
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such checkpoint folder")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise CheckpointError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
        dtype = DTYPES[dtype]
    config = Qwen3Config.from_json(folder / "config.json")
    entries = split_fused_experts(read_checkpoint_index(folder), config)
    with torch.device("meta"):
        model = Qwen3(config)
    _check_expert_count(entries, config)
    _check_matches_model(entries, model, config)
    tied_head = config.tie_word_embeddings
    params = {name: entries[name] for name, _ in model.named_parameters()}
    shards = {file: map_shard(file) for file in {entry.file for entry in entries.values()}}  # each opened once
    if tied_head and "lm_head.weight" in entries:  # tied, but saved anyway: it must equal the embedding
        stored = {name: tensor_from_map(shards[entries[name].file], entries[name], "cpu", entries[name].dtype)
                  for name in ("lm_head.weight", "model.embed_tokens.weight")}  # fmt: skip
        if not torch.equal(stored["lm_head.weight"], stored["model.embed_tokens.weight"]):
            raise CheckpointError(
                f"{entries['lm_head.weight'].file}: lm_head.weight differs from the embedding but config.json "
                "says tie_word_embeddings=true; fix the config"
            )
    loaded = {name: tensor_from_map(shards[entry.file], entry, device, dtype) for name, entry in params.items()}
    for name, tensor in loaded.items():
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, nn.Parameter(tensor, requires_grad=False))
    if tied_head:
        model.lm_head.weight = model.model.embed_tokens.weight
    del loaded  # the model holds each tensor now; a transform below must be able to free the ones it replaces
    model.build_rope_tables(device, dtype)
    if optimize:
        fuse_projections(model)
    if quantize is not None:
        quantize_model(model, quantize)
    if optimize:
        prepack_for_cpu(model)  # no-op off the CPU; int8 layers are already in their own layout
    return model.eval()
